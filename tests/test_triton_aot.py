"""Every Triton kernel compiled ahead of time for sm_90 and sm_80 on this CPU machine, through the real launch
wrappers (batchgen_kernels/triton_aot.py: how; tests/aot_runner.py: the run, one process per target, both at once).

What it proves: each kernel compiles for the GPU at the engine's configurations and the kernel tests'; its shared
memory fits the target; bf16/fp16 attention runs on tensor cores without spilling registers (fp32 spills are
recorded, not failed); the engine's shape limits (triton_limits) sit where compilation starts failing; a run
compiles no kernel after the engine's warm-up. The two planted bugs (head_dim 8, an oversized tile) must be
reported as failures, so the checks are seen to bite. What it cannot prove: numbers, speed, and the launch itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from batchgen_kernels import triton_limits  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGETS = ("sm_90", "sm_80")
# The variants a run needs per kernel: the decode's one-split and several-split forms, one of each other kernel.
VARIANT_BOUND = {"_store_kv_kernel": 1, "_decode_split_kernel": 2, "_decode_reduce_kernel": 1, "_prefill_kernel": 1}
# The MoE experts' grouped matmul (triton_moe.py): gate/up and down, each in 16-row and 64-row blocks, per model
# shape and dtype, whatever the step's token count.
MOE_VARIANTS = {"_grouped_matmul_kernel": 4}
# The LoRA deltas (triton_lora.py): the shrink and the expand, each in decode-sized and prefill-sized blocks, per
# chunk of rank columns (SmolLM2's slots of rank 8 and 16 take chunks of 16, its q/k/v slot of 24 one of 32; the
# widest rank chunks of 64), whatever the step's row count.
LORA_VARIANTS = {"SmolLM2-135M": {"_lora_shrink_kernel": 4, "_lora_expand_kernel": 4},
                 "widest": {"_lora_shrink_kernel": 2, "_lora_expand_kernel": 2}}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """Both targets compiled at once, each in a fresh process with an empty Triton cache and no interpreter."""
    base = tmp_path_factory.mktemp("aot")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "kernels")])
    runs = {}
    for target in TARGETS:
        env_target = {**env, "TRITON_CACHE_DIR": str(base / f"cache-{target}")}
        extra = ["--specialisations"] if target == "sm_90" else []
        command = [sys.executable, str(REPO / "tests" / "aot_runner.py"), "--target", target,
                   "--out", str(base / f"{target}.json"), *extra]
        runs[target] = subprocess.Popen(command, env=env_target, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
    results = {}
    for target, run in runs.items():
        output, _ = run.communicate(timeout=600)
        assert run.returncode == 0, output[-4000:]
        results[target] = json.loads((base / f"{target}.json").read_text())
    return results


def describe(report: dict) -> str:
    case = report["case"]
    return (f"{report['target']} {case['dtype']} D{case['head_dim']} group {case['group']} block {case['block_size']}"
            f"{' kv int8' if case['kv_int8'] else ''}")


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_compiles_within_the_target_s_limits(reports, target):
    failures = [f"{describe(r)}: {'; '.join(r['problems'])}" for r in reports[target]["cases"] if r["problems"]]
    assert not failures, "\n".join(failures)
    compiled = {v["kernel"] for kind in ("cases", "moe", "lora") for r in reports[target][kind] for v in r["variants"]}
    assert compiled == set(reports[target]["defined_kernels"]) == (set(VARIANT_BOUND) | set(MOE_VARIANTS)
                                                                   | set(LORA_VARIANTS["widest"]))


def variant_counts(target: str, report: dict) -> dict[str, int]:
    """Compiled variants per kernel of a runner's MoE or LoRA report, which must have no problem."""
    assert not report["problems"], f"{target} {report['case']}: {'; '.join(report['problems'])}"
    counts: dict[str, int] = {}
    for v in report["variants"]:
        counts[v["kernel"]] = counts.get(v["kernel"], 0) + 1
    return counts


@pytest.mark.parametrize("target, instruction", [("sm_90", "wgmma"), ("sm_80", "mma")])
def test_the_moe_kernel_compiles_for_mixtral_and_qwen3_moe_shapes(reports, target, instruction):
    """bf16 and fp16 at Mixtral-8x7B's (hidden 4,096, experts of 14,336, 8 experts, top-2, fp32 routing weights)
    and Qwen3-30B-A3B's (2,048, 768, 128 experts, top-8) expert shapes, steps of 1 to 4,096 tokens: within the
    target's shared memory, on tensor cores, no spills (the runner's checks), and no variant per step size. The
    64-row blocks get Hopper's wgmma on sm_90; the 16-row ones mma.sync."""
    moe = reports[target]["moe"]
    assert [r["case"] for r in moe] == ["bfloat16 Mixtral-8x7B", "bfloat16 Qwen3-30B-A3B", "float16 Mixtral-8x7B",
                                        "float16 Qwen3-30B-A3B"]
    for report in moe:
        assert variant_counts(target, report) == MOE_VARIANTS, report["case"]
        assert {v["tensor_cores"] for v in report["variants"]} == {instruction, "mma"}, report["case"]


@pytest.mark.parametrize("target, instruction", [("sm_90", "wgmma"), ("sm_80", "mma")])
def test_the_lora_kernels_compile_for_smollm2_and_the_widest_shape(reports, target, instruction):
    """bf16 and fp16 at SmolLM2-135M's projections with rank 8 adapters (q/k/v packed: a slot of rank 24; gate/up:
    16; o and down: 8), bf16 and fp32 at the widest shape lora_delta takes (rank MAX_RANK, 16,384 features in and
    out), steps of 1 to 4,096 rows: within the target's shared memory, and in 16-bit on tensor cores without spills
    (the runner's checks), and no variant per step size. sm_90's 64-row shrink gets wgmma, the rest mma.sync; fp32
    multiplies in IEEE fp32, off tensor cores (its spills are recorded, as the attention's are)."""
    lora = reports[target]["lora"]
    assert [r["case"] for r in lora] == ["bfloat16 SmolLM2-135M", "float16 SmolLM2-135M", "bfloat16 widest",
                                         "float32 widest"]
    for report in lora:
        assert variant_counts(target, report) == LORA_VARIANTS[report["case"].split()[1]], report["case"]
        found = {v["tensor_cores"] for v in report["variants"]}
        assert found == ({""} if report["case"].startswith("float32") else {instruction, "mma"}), report["case"]
        if report["notes"]:  # fp32's spills, for the record
            print(f"{target} {report['case']}: {'; '.join(report['notes'])}")


@pytest.mark.parametrize("target, instruction", [("sm_90", "wgmma"), ("sm_80", "mma")])
def test_16_bit_attention_runs_on_tensor_cores(reports, target, instruction):
    """The checker fails a 16-bit case without tensor cores; this pins which instruction each target gets: Hopper's
    wgmma for the prefill's 64-row tiles, mma.sync for the decode's (and everything on Ampere)."""
    for report in reports[target]["cases"]:
        if report["case"]["dtype"] == "float32":
            assert all(not v["tensor_cores"] for v in report["variants"]), describe(report)  # IEEE fp32: no TF32
            continue
        found = {v["kernel"]: v["tensor_cores"] for v in report["variants"]}
        assert found["_prefill_kernel"] == instruction and found["_decode_split_kernel"] == "mma", describe(report)


def test_only_fp32_spills(reports):
    notes = [(describe(r), note) for target in TARGETS for r in reports[target]["cases"] for note in r["notes"]]
    assert all("float32" in case for case, _ in notes), notes
    print("\n".join(f"{case}: {note}" for case, note in notes))  # the known fp32 spills, for the record


@pytest.mark.parametrize("target", TARGETS)
def test_every_attention_kernel_compiles_for_an_int8_cache(reports, target):
    """engine.kv_cache_dtype int8 on the Triton kernels: the store (quantizing), the decode (one split and several),
    its reduction and the prefill, each compiled over an int8 cache with its scales at the engine's shapes, the
    kernel tests' fp32 one and the widest bf16 head, within the checks above (16-bit: tensor cores, no spills). fp32
    spills no more than over an fp32 cache (tens of bytes; pipelined, its decode spilled 4 KB per thread)."""
    cases = [r for r in reports[target]["cases"] if r["case"]["kv_int8"]]
    assert [(r["case"]["dtype"], r["case"]["head_dim"]) for r in cases] == [
        ("bfloat16", 64), ("bfloat16", 128), ("float32", 80), ("bfloat16", 256)]
    for report in cases:
        assert not report["problems"], describe(report)
        kernels = [v["kernel"] for v in report["variants"]]
        assert sorted(set(kernels)) == sorted(VARIANT_BOUND), describe(report)
        assert kernels.count("_decode_split_kernel") == 2, describe(report)
        assert max(v["spill_bytes"] for v in report["variants"]) <= 128, describe(report)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("planted, expected", [(0, "does not compile: CompilationError: Input shapes should have"),
                                               (1, "_prefill_kernel needs")])
def test_the_planted_bugs_are_reported(reports, target, planted, expected):
    """The checker's teeth: head_dim 8 (tl.dot needs 16) and a 64x256 prefill tile (shared memory) both fail."""
    report = reports[target]["planted"][planted]
    assert report["problems"] and report["problems"][0].startswith(expected), report["problems"]
    if planted == 1:
        assert "shared memory" in report["problems"][0]


def test_the_engine_s_limits_sit_where_compilation_fails(reports):
    """Every compiled case is inside triton_limits' envelope (its edges included: the matrix has them), and the
    planted head_dim, which does not compile, is outside it: the engine refuses exactly what fails."""
    for report in reports["sm_90"]["cases"]:
        case = report["case"]
        dtype = getattr(torch, case["dtype"])
        assert triton_limits.unsupported_reason(case["head_dim"], case["group"] * case["num_kv_heads"],
                                                case["num_kv_heads"], dtype) is None, describe(report)
    head_dims = {(r["case"]["dtype"], r["case"]["head_dim"]) for r in reports["sm_90"]["cases"]}
    assert {("bfloat16", triton_limits.MIN_HEAD_DIM), ("bfloat16", 256), ("float32", 128)} <= head_dims
    planted = reports["sm_90"]["planted"][0]["case"]
    assert "below 16" in triton_limits.unsupported_reason(planted["head_dim"], 8, 2, torch.bfloat16)


def test_a_run_compiles_nothing_after_the_warm_up(reports):
    """A realistic sequence of eager and CUDA-graph steps (0, 1, 3, 16 decodes next to a prefill; 1 to 256 sequences;
    contexts of one block to 40,000 tokens, 1 to 32 splits) through a model with a sliding-window layer and a
    full one compiles no variant the engine's warm-up did not, and the variants are the bounded set: both kinds
    of layer share them; the same over an int8 cache. Planted: with every argument specialised again (no
    do_not_specialize), the window (512, a multiple of 16, against -1) splits the warm-up's variants by layer,
    and the steps compile new ones, so the count has teeth."""
    for key in ("specialisations", "specialisations_int8"):  # over a bf16 cache and over an int8 one
        found = reports["sm_90"][key]
        assert found["after_run"] == found["after_warm_up"] == VARIANT_BOUND, (key, found)
        assert found["launches"] > 100
    planted = reports["sm_90"]["specialisations_planted"]
    warm, run = planted["after_warm_up"], planted["after_run"]
    assert warm["_prefill_kernel"] == 2 * VARIANT_BOUND["_prefill_kernel"], planted
    assert warm["_decode_split_kernel"] == 2 * VARIANT_BOUND["_decode_split_kernel"], planted
    assert run["_prefill_kernel"] > warm["_prefill_kernel"], planted
    assert run["_decode_split_kernel"] > warm["_decode_split_kernel"], planted
