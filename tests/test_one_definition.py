"""One definition of each fact the engine decides at start-up (issue 39, part 1), as tests/test_layout.py checks the
layers: each rule below reads the source of batchgen/ and kernels/ and names the one file allowed to hold the fact,
so that a second derivation cannot come back unnoticed. Where each lived before, for the record:

- device and dtype: engine/startup.py, job/plan/estimate.py, job/prepare.py (twice), bench/harness.py (twice),
  job/runner.py; now engine/engine_plan.py (resolve_target), which everything calls;
- the KV sizing sequence (budget → context → pool): engine/startup.py and job/plan/estimate.py; now plan_engine;
- KV bytes per token: engine/startup.py, bench/gpu/shapes.py, bench/hf_continuous.py; now engine_plan.py;
- the roofline's own budget from raw psutil (no cgroup cap): now machine.free_memory;
- model shapes from a config: job/plan/memory.py, bench/gpu/shapes.py, bench/roofline_floor.py; now the model
  inspector (models/inspector.py), whose shapes are the architecture's own (models/llama.py's attention_heads);
- safetensors headers: job/plan/memory.py, models/weight_reader.py, models/gguf_cache.py; now
  models/safetensors_header.py;
- /proc/cpuinfo: batchgen/machine.py and kernels/batchgen_kernels/cpu_build.py; the cache root: models/gguf_cache.py
  and cpu_build.py; now kernels/batchgen_kernels/host.py (batchgen imports batchgen_kernels, never the reverse)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "batchgen").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])

ENGINE_PLAN = "batchgen/engine/engine_plan.py"
INSPECTOR = "batchgen/models/inspector.py"
HEADER = "batchgen/models/safetensors_header.py"
HOST = "kernels/batchgen_kernels/host.py"
MACHINE = "batchgen/machine.py"


def trees() -> dict[str, ast.AST]:
    return {str(path.relative_to(ROOT)): ast.parse(path.read_text()) for path in SOURCES}


TREES = trees()


def where(found) -> set[str]:
    """The files in which `found(node)` holds for some node."""
    return {name for name, tree in TREES.items() if any(found(node) for node in ast.walk(tree))}


def defined_in(*names: str) -> set[str]:
    """The files that define a module-level function or class named one of `names`."""
    return {name for name, tree in TREES.items()
            if any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names for node in tree.body)}


def called(node: ast.AST, *names: str) -> bool:
    """A call of a function or method named one of `names`."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in names


def constants(node: ast.AST) -> set:
    return {inner.value for inner in ast.walk(node) if isinstance(inner, ast.Constant)}


def product_of(node: ast.AST) -> set[str]:
    """The names and attributes multiplied together in a chain of `*` (empty for anything else)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return set()
    names = set()
    for side in (node.left, node.right):
        if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult):
            names |= product_of(side)
        elif isinstance(side, ast.Name):
            names.add(side.id)
        elif isinstance(side, ast.Attribute):
            names.add(side.attr)
    return names


def test_device_and_dtype_are_resolved_in_the_engine_plan():
    assert defined_in("resolve_device", "resolve_dtype", "check_quantization", "resolve_target") == {ENGINE_PLAN}
    # Everyone else asks resolve_target (device, dtype, the quantization's verdict) or reads the engine's plan.
    assert where(lambda n: called(n, "resolve_device", "resolve_dtype")) == {ENGINE_PLAN}
    assert defined_in("resolved_dtype") <= {"batchgen/bench/run_common.py"}  # resolve_target's name


def test_the_kv_sizing_sequence_is_the_engine_plans():
    assert where(lambda n: called(n, "size_kv_pool")) == {ENGINE_PLAN}
    assert where(lambda n: called(n, "context_length", "context_limit")) == {ENGINE_PLAN}
    assert defined_in("context_length", "context_limit", "kv_group_bytes") == {ENGINE_PLAN}
    assert defined_in("kv_pool_size") == set()  # startup's own sizing, gone


def test_kv_bytes_per_token_has_one_formula():
    def formula(node):  # layers x kv heads x head_dim, multiplied out
        names = product_of(node)
        return any("layers" in name for name in names) and any("kv_heads" in name for name in names) \
            and any("head_dim" in name for name in names)

    assert where(formula) == {ENGINE_PLAN}
    assert defined_in("kv_bytes_per_token") == {ENGINE_PLAN}


def test_free_memory_is_read_in_machine_py():
    assert where(lambda n: isinstance(n, ast.Attribute) and n.attr == "virtual_memory") == {MACHINE}
    assert where(lambda n: called(n, "cgroup_room")) == {MACHINE}


def test_model_shapes_come_from_the_inspector():
    config_keys = {"num_key_value_heads", "head_dim", "num_hidden_layers", "num_attention_heads"}

    def reads_a_config_key(node):  # getattr(config, "head_dim", ...) or config["num_attention_heads"]
        if called(node, "getattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            return node.args[1].value in config_keys
        return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
            node.slice.value in config_keys

    # attention_heads: the native architectures' rule; generic_support.describe: the generic path's, read off the
    # transformers model's own attention modules
    assert where(reads_a_config_key) == {"batchgen/models/llama.py", "batchgen/models/generic_support.py"}
    assert where(lambda n: called(n, "attention_heads")) <= {"batchgen/models/llama.py", "batchgen/models/gemma3.py"}
    assert defined_in("ModelDescription", "CheckpointTensor", "describe_config") == {INSPECTOR}
    assert defined_in("ModelShape") <= {"batchgen/bench/gpu/shapes.py"}  # a view of the description


def test_safetensors_headers_are_read_in_one_place():
    assert where(lambda n: isinstance(n, ast.Constant) and n.value == "<Q") == {HEADER}
    assert where(lambda n: isinstance(n, ast.Constant) and n.value == "__metadata__") == {HEADER}
    assert defined_in("read_safetensors_header") == {HEADER}


def test_cpuinfo_and_the_cache_root_are_read_in_one_place():
    assert where(lambda n: isinstance(n, ast.Constant) and n.value == "/proc/cpuinfo") == {HOST}
    assert where(lambda n: isinstance(n, ast.BinOp) and {".cache", "batchgen"} <= constants(n)) == {HOST}


def test_the_kernels_never_import_batchgen():
    """So that host.py can be the one definition both packages use: batchgen imports batchgen_kernels only."""
    def imports_batchgen(node):
        if isinstance(node, ast.Import):
            return any(alias.name.split(".")[0] == "batchgen" for alias in node.names)
        return isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "batchgen"

    assert {name for name in where(imports_batchgen) if name.startswith("kernels/")} == set()
