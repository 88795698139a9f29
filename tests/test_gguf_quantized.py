"""GGUF files kept quantized: converted one tensor at a time into int8 weights + per-row scales
(models/gguf_convert.py), loaded as int8 without a float copy (models/gguf_int8.py), on tiny random GGUFs of every
supported quant type written by dev/make_random_gguf.py, and on the default model.

The greedy rule: batchgen's int8 model equals, token for token (the fp32 near-tie rule of bench/greedy_check.py),
transformers' own fp32 run of the same GGUF whose Linear weights are replaced by their int8 reference: transformers'
dequantized weight, requantized in torch by quantization.quantize_weight (scales rounded to bf16, as the conversion
does; a tied head's copy with fp32 scales, as the loader makes it) and multiplied back. batchgen runs it in fp32
with weight-only int8 (the loader's INT8_OPTIONS), so that the activations are not quantized: what differs from
the reference is then only the order of fp32 sums."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from safetensors import safe_open

from batchgen.bench.greedy_check import assert_greedy_matches, hf_greedy
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.job.plan import memory
from batchgen.models import loader
from batchgen.models.accounting import weight_bytes
from batchgen.models.gguf_convert import convert_gguf
from batchgen.models.gguf_int8 import INT8_CONFIG_KEY, SCALE_SUFFIX
from batchgen.models.quantization import Int8Linear, quantize_weight
from cli_runs import run_cli
from test_plan import write_input

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("make_random_gguf", ROOT / "dev" / "make_random_gguf.py")
make_random_gguf = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_random_gguf)

MiB = 2**20
PROMPTS = ["Hello there, how are you today?", "The quick brown fox jumps", "1, 2, 3, 4,",
           "Write a short poem about the sea.", "Translate to French: good morning", "What is 17 times 23?"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    """One tiny GGUF (2 layers, 2,048 tokens, untied head) per type; written on first use."""
    root = tmp_path_factory.mktemp("ggufs")
    return {kind: root / f"tiny-{kind}.gguf" for kind in (*make_random_gguf.TYPES, "Q4_K_M", "tied")}


def gguf_of(tiny_ggufs: dict[str, Path], kind: str) -> Path:
    path = tiny_ggufs[kind]
    if not path.exists():
        make_random_gguf.write_random_gguf(path, "tiny", "Q8_0" if kind == "tied" else kind,
                                           overrides={"tied": kind == "tied"})
    return path


def converted(gguf: Path, int8: bool = True) -> Path:
    out = gguf.parent / f"{gguf.stem}-{'int8' if int8 else 'fp32'}"
    if not out.exists():
        out.mkdir()
        convert_gguf(gguf, out, int8)
    return out


def int8_reference(gguf: Path):
    """transformers' fp32 model of the GGUF, its Linear weights replaced by their int8 reference (module doc)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True)).eval()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = quantize_weight(module.weight, torch.float32 if name == "lm_head" and tied
                                           else torch.bfloat16)
                module.weight = torch.nn.Parameter(q.float() * scale.float()[:, None], requires_grad=False)
    return model


def greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = {r.request_id: r.token_ids for r in engine.generate(Request(i, p, params) for i, p in enumerate(prompts))}
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("kind", [*make_random_gguf.TYPES, "Q4_K_M", "tied"])
def test_each_type_is_held_int8_and_matches_its_int8_reference(tiny_ggufs, kind):
    gguf = gguf_of(tiny_ggufs, kind)
    model_dir = converted(gguf)
    config = json.loads((model_dir / "config.json").read_text())
    assert config[INT8_CONFIG_KEY]["source"] == "gguf"
    with mock.patch.dict(loader.INT8_OPTIONS, {"activations": "weight_only"}):
        engine = Engine(EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB"))
    model = engine.model
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    int8 = [name for name, module in model.named_modules() if isinstance(module, Int8Linear)]
    assert linears == [] and len(int8) == 4 * model.num_layers + 1  # qkv, o, gate_up, down; the head
    reference = int8_reference(gguf)
    linear = {f"{name}.weight" for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    held = sum(p.numel() + 4 * p.shape[0] if name in linear else 4 * p.numel()  # int8 + scales; fp32 the rest
               for name, p in reference.named_parameters())
    assert weight_bytes(model) == held
    prompts = [engine.tokenizer(text)["input_ids"] for text in PROMPTS]
    references = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    assert_greedy_matches(reference, prompts, references, greedy(engine, prompts))


def test_a_generic_path_architectures_gguf_is_held_int8_too(tiny_ggufs):
    """Phi-3 (fused q/k/v and gate/up; no native implementation): converted one tensor at a time like a Llama, each
    of transformers' Linear layers loaded as an Int8Linear on the generic path, its greedy tokens those of its int8
    reference; `batchgen run` of it holds int8 too."""
    gguf = tiny_ggufs["Q8_0"].parent / "tiny-phi3.gguf"
    if not gguf.exists():
        make_random_gguf.write_random_gguf(gguf, "tiny", "Q8_0", overrides={"arch": "phi3"})
    model_dir = converted(gguf)
    assert json.loads((model_dir / "config.json").read_text())[INT8_CONFIG_KEY]["source_types"] == {"Q8_0": 9}
    with mock.patch.dict(loader.INT8_OPTIONS, {"activations": "weight_only"}):
        engine = Engine(EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB"))
    assert engine.stats()["model_path"] == "generic"
    int8 = [name for name, module in engine.model.named_modules() if isinstance(module, Int8Linear)]
    assert len(int8) == 4 * 2 + 1  # qkv, o, gate_up, down of 2 layers; the head
    reference = int8_reference(gguf)
    prompts = [engine.tokenizer(text)["input_ids"] for text in PROMPTS]
    references = [hf_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    assert_greedy_matches(reference, prompts, references, greedy(engine, prompts))



    """Every matrix int8 + fp32 scales whose q * scale is within half a step of the dequantized GGUF weight (also
    after transformers' q/k reverse permute); the embedding and norms exactly the GGUF's values."""
    gguf = gguf_of(tiny_ggufs, "Q4_K_M")
    float_dir, int8_dir = converted(gguf, int8=False), converted(gguf)
    with safe_open(str(float_dir / "model.safetensors"), "pt") as plain, \
            safe_open(str(int8_dir / "model.safetensors"), "pt") as stored:
        assert set(stored.keys()) - set(plain.keys()) == {f"{name}{SCALE_SUFFIX}" for name in plain.keys()
                                                          if name.endswith("proj.weight") or name == "lm_head.weight"}
        for name in plain.keys():
            weight = plain.get_tensor(name)
            if f"{name}{SCALE_SUFFIX}" not in stored.keys():
                assert torch.equal(stored.get_tensor(name), weight), name
                continue
            q, scale = stored.get_tensor(name), stored.get_tensor(f"{name}{SCALE_SUFFIX}")
            assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == weight.shape
            assert torch.equal(scale, scale.bfloat16().float())  # the same weight in bf16 or fp32 scales
            assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] * 0.51).all(), name


def test_the_activations_follow_the_dtype_and_the_jobs_quantization(tiny_ggufs):
    model_dir = converted(gguf_of(tiny_ggufs, "Q4_K"))
    cases = {(torch.float32, None): "dynamic_int8", (torch.bfloat16, None): "weight_only",
             (torch.bfloat16, "int8"): "dynamic_int8", (torch.bfloat16, "int8-weight-only"): "weight_only",
             (torch.float32, "int8"): "dynamic_int8"}
    for (dtype, quantization), activations in cases.items():
        model = loader.load_model(model_dir, dtype, "cpu", quantization, pack=True)
        layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        assert {m.activations for m in layers} == {activations}, (dtype, quantization)
        assert {m.scale.dtype for m in layers} == {dtype if activations == "weight_only" else torch.float32}
        assert model.model.embed_tokens.weight.dtype == dtype


def test_the_plans_weight_bytes_are_what_the_loader_holds(tiny_ggufs):
    for kind in ("Q6_K", "tied"):
        model_dir = converted(gguf_of(tiny_ggufs, kind))
        for dtype in (torch.float32, torch.bfloat16):
            shape, weights = memory.inspect_model(model_dir, dtype, on_cpu=True)
            held = weight_bytes(loader.load_model(model_dir, dtype, "cpu", pack=True))
            assert abs(weights.loaded - held) <= 0.02 * held, (kind, dtype, weights.loaded, held)
            assert memory.packed_weight_bytes(shape, dtype) == 0  # nothing packed: every matmul weight is int8


def test_an_int8_weight_without_its_scales_is_named(tiny_ggufs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    source = converted(gguf_of(tiny_ggufs, "Q8_0"))
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors[f"model.layers.1.mlp.down_proj.weight{SCALE_SUFFIX}"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(loader.ModelError, match=r"down_proj\.weight is stored in int8 without its scales"):
        loader.load_model(broken, torch.float32, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_batchgen_run_on_a_gguf_is_int8_and_within_its_bound(tiny_ggufs, tmp_path, arch):
    """The CLI from the .gguf file: converted into the cache (an int8 entry), run, its peak under the printed bound
    and its weights the int8 figure; Phi-3 on the generic path."""
    if arch == "llama":
        gguf = gguf_of(tiny_ggufs, "Q4_K_M")
    else:
        gguf = make_random_gguf.write_random_gguf(tmp_path / "phi3.gguf", "tiny", "Q4_K_M",
                                                  overrides={"arch": "phi3"})
    inputs = write_input(tmp_path / "in.parquet", PROMPTS)
    job = {"model": str(gguf), "dtype": "bfloat16", "device": "cpu",
           "input": {"path": str(inputs), "id_column": "id"}, "sampling": {"max_tokens": 6},
           "engine": {"kv_cache_memory": "16MiB"}, "output": {"path": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {"BATCHGEN_CACHE_DIR": str(tmp_path / "cache"), "BATCHGEN_NO_CPU_KERNELS": "1"}
    with mock.patch.dict("os.environ", env):
        proc = run_cli(tmp_path / "job.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert summary["rows_ok"] == len(PROMPTS)
    assert summary["engine_stats"]["model_path"] == ("native" if arch == "llama" else "generic")
    assert summary["peak_memory_bytes"] <= summary["memory_bound_bytes"]
    [entry] = (tmp_path / "cache" / "gguf").iterdir()
    assert INT8_CONFIG_KEY in json.loads((entry / "config.json").read_text())
    _, planned = memory.inspect_model(entry, torch.bfloat16, on_cpu=True)
    assert abs(summary["engine_stats"]["weights_bytes"] - planned.loaded) <= 0.02 * planned.loaded


_CONVERSION_RSS = """
import json, resource, sys
from pathlib import Path
from batchgen.models.gguf_convert import convert_gguf
warm, big, out = map(Path, sys.argv[1:4])
(out / "warm").mkdir(); convert_gguf(warm, out / "warm")  # every import and lazy module loaded first
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
(out / "big").mkdir(); convert_gguf(big, out / "big")
print(json.dumps({"before": before, "after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


@pytest.mark.slow
def test_conversion_holds_a_few_tensors_not_the_model(tiny_ggufs, tmp_path):
    """A 16-layer Q4_K GGUF of 0.9 GiB in fp32, its largest tensor 16 MiB in fp32: the conversion's peak RSS grows
    by less than 8 of those tensors (it grew by the model's fp32 size and more when transformers loaded it whole)."""
    big = make_random_gguf.write_random_gguf(tmp_path / "wide.gguf", "tiny", "Q4_K", overrides={
        "hidden": 1024, "intermediate": 4096, "layers": 16, "heads": 16, "kv_heads": 4})
    largest = 4096 * 1024 * 4
    proc = subprocess.run([sys.executable, "-c", _CONVERSION_RSS, str(gguf_of(tiny_ggufs, "Q4_K")), str(big),
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = rss["after"] - rss["before"]
    with safe_open(str(tmp_path / "big" / "model.safetensors"), "pt") as f:
        model_fp32 = sum(4 * math.prod(f.get_slice(name).get_shape()) for name in f.keys()
                         if not name.endswith(SCALE_SUFFIX))
    assert model_fp32 > 0.8 * 2**30
    assert grown < 8 * largest, f"conversion grew RSS by {grown / MiB:,.0f} MiB (model {model_fp32 / MiB:,.0f} MiB)"


def test_the_default_models_cache_entry_is_int8(default_int8_dir):
    """SmolLM2-135M's entry: int8 matrices + scales, fp32 embedding and norms, 220 MB (538 MB when it was fp32)."""
    size = (default_int8_dir / "model.safetensors").stat().st_size
    assert size < 260 * 10**6, size
    assert json.loads((default_int8_dir / "config.json").read_text())[INT8_CONFIG_KEY]["source_types"] == \
        {"Q4_1": 210}
    with safe_open(str(default_int8_dir / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "I8"
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
        assert "lm_head.weight" not in f.keys()  # tied: the loader makes the head's int8 copy
