"""int8 in the bench and the plan: `quantization: int8-weight-only` in the engine (bf16 only on the CPU), the
compressed-tensors W8A8 copy vLLM runs (batchgen's own int8 weights), what the vLLM system runs or refuses, the
roofline timing each (dtype, quantization), and `batchgen plan` naming the fastest from such a record."""
from __future__ import annotations

import json
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from batchgen.bench import vllm_system
from batchgen.bench.roofline import RooflineConfig, run_roofline
from batchgen.bench.roofline_report import format_roofline
from batchgen.bench.system_types import BenchOptions
from batchgen.bench.vllm_checkpoint import DONE, QUANTIZED, w8a8_checkpoint
from batchgen.cli import main
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.errors import SettingError
from batchgen.job import load_job
from batchgen.job.plan.estimate import make_plan
from batchgen.engine.cpu_features import w8a8_slow_reason
from batchgen.job.plan.precision_advice import advise_precision, label
from batchgen.machine import machine_info
from batchgen.models.quantization import Int8Linear, quantize_weight
from test_plan import tiny_chat_model, tiny_job  # noqa: F401 (fixtures)


def test_engine_int8_weight_only_in_bf16_and_refused_in_fp32(tiny_llama_dir):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), dtype="bfloat16", quantization="int8-weight-only",
                               kv_cache_memory="16MiB"))
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * engine.model.num_layers + 1 and {m.activations for m in layers} == {"weight_only"}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 200], list(range(3, 60))]
    together = sorted(engine.generate(Request(i, p, params) for i, p in enumerate(prompts)), key=lambda r: r.request_id)
    alone = list(engine.generate([Request("again", prompts[1], params)]))[0]
    assert [len(r.token_ids) for r in together] == [8, 8] and alone.token_ids == together[1].token_ids
    with pytest.raises(SettingError, match="needs bfloat16") as info:
        Engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", quantization="int8-weight-only"))
    assert info.value.key == "quantization"


def test_plan_refuses_int8_weight_only_in_fp32(tiny_job):
    result = CliRunner().invoke(main, ["plan", str(tiny_job), "--set", "engine.quantization=int8-weight-only"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith("batchgen: error: engine.quantization: ")
    assert "bfloat16" in result.output


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_w8a8_checkpoint_holds_batchgens_int8_weights(tiny_llama_dir, tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    out = w8a8_checkpoint(tiny_llama_dir, dtype)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 8
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"] is True
    with safe_open(str(tiny_llama_dir / "model.safetensors"), "pt") as source, \
            safe_open(str(out / "model.safetensors"), "pt") as copy:
        names = set(source.keys())
        assert set(copy.keys()) == names | {f"{n}_scale" for n in names if QUANTIZED.match(n)}
        quantized = [n for n in names if QUANTIZED.match(n)]
        assert len(quantized) == 7 * 2  # q, k, v, o, gate, up, down in each of 2 layers; not the head
        for name in names:
            original = source.get_tensor(name)
            if name in quantized:
                q, scale = quantize_weight(original.to(getattr(torch, dtype)))
                assert torch.equal(copy.get_tensor(name), q) and copy.get_tensor(name).dtype == torch.int8
                assert torch.equal(copy.get_tensor(f"{name}_scale"), scale[:, None])
            else:
                assert torch.equal(copy.get_tensor(name), original)
    assert (out / DONE).is_file() and (out / "generation_config.json").is_file()
    stamp = os.stat(out / "model.safetensors").st_mtime_ns
    assert w8a8_checkpoint(tiny_llama_dir, dtype) == out  # made once
    assert os.stat(out / "model.safetensors").st_mtime_ns == stamp


def test_vllm_runs_w8a8_and_has_no_weight_only(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "worker.py").write_text(MODEL_DIR_WORKER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'worker.py'} \"$@\"\n")
    python.chmod(0o755)
    rows = [SimpleNamespace(id=0, token_ids=[5, 6, 7], max_tokens=2)]

    def run(quantization):
        args = EngineArgs(model=str(tiny_llama_dir), quantization=quantization)
        return vllm_system.run(rows, BenchOptions(args, vllm_python=str(python), dtype="bfloat16"))

    w8a8 = run("int8")
    assert w8a8.available and w8a8.details["quantization"] == "int8 W8A8"
    assert w8a8.details["vllm_version"] == str(w8a8_checkpoint(tiny_llama_dir, "bfloat16"))  # what the worker got
    assert run(None).details["vllm_version"] == str(tiny_llama_dir)
    weight_only = run("int8-weight-only")
    assert not weight_only.available and "no int8 weight-only kernel" in weight_only.reason


MODEL_DIR_WORKER = """
import json, sys, time
spec = json.load(open(sys.argv[2]))
rows = [{"id": r["id"], "token_ids": [1] * r["max_tokens"], "num_cached_tokens": 0, "first_token_s": None,
         "finish_s": None} for r in spec["rows"]]
json.dump({"vllm_version": spec["model_dir"], "load_s": 0.1, "ready_monotonic": time.monotonic(), "wall_s": 0.1,
           "rows": rows}, open(sys.argv[3], "w"))
"""


def test_roofline_times_each_quantization_and_the_plan_names_the_fastest(tiny_chat_model, tiny_job, tmp_path):
    archive = tmp_path / "archive.jsonl"
    config = RooflineConfig(model=str(tiny_chat_model), dtypes=("float32", "bfloat16"),
                            quantizations=(None, "int8-weight-only"), batches=(1, 4), contexts=(16,),
                            prefill_seqs=0, prefill_len=0, warmup=0, reps=1, bandwidth_bytes=2**20, matmul_n=64,
                            out_dir=str(tmp_path / "out"), archive=str(archive))
    record = run_roofline(config, log=lambda line: None)
    variants = {(case["dtype"], case["quantization"]) for case in record["decode"]}
    assert variants == {("float32", None), ("bfloat16", None), ("bfloat16", "int8-weight-only")}
    assert set(record["models"]) == {"float32", "bfloat16", "bfloat16+int8-weight-only"}
    assert all(entry["skipped"] == "not asked for (--roofline-prefill none)" for entry in record["prefill"])
    [skipped] = record["skipped_variants"]
    assert (skipped["dtype"], skipped["quantization"]) == ("float32", "int8-weight-only")
    assert "needs bfloat16" in skipped["skipped"]
    int8_bytes = record["models"]["bfloat16+int8-weight-only"]["counts"]["weight_bytes"]
    assert int8_bytes < record["models"]["bfloat16"]["counts"]["weight_bytes"]  # the floor reads int8 weights
    table = format_roofline(record)
    assert "bf16 int8 weight-only" in table and "fp32 int8 weight-only: skipped" in table

    plan = make_plan(load_job(tiny_job), archive=archive)  # this machine, the record's
    batch = int(re.match(r"precision: at the job's decode batch \(~\d+; batch (\d+) measured\)",
                         plan.precision[0]).group(1))
    times = {(c["dtype"], c["quantization"]): c["best_s"] for c in record["decode"] if c["batch"] == batch}
    fastest = min(times, key=times.get)
    assert plan.precision[1].startswith(f"  decode step {label(fastest)} ")
    if fastest != ("float32", None) and times[("float32", None)] / times[fastest] >= 1.05:
        assert plan.precision[3].startswith("  faster than the job's fp32: ")
    else:
        assert plan.precision[3] == "  the job's fp32 is the fastest measured"
    assert plan.precision[4].startswith("  int8-weight-only vs bf16, decode step: ")
    printed = CliRunner().invoke(main, ["plan", str(tiny_job), "--archive", str(archive)])
    assert printed.exit_code == 0 and plan.precision[0] in printed.output


def _record(cases: list[tuple], cpu: dict, prefill: dict | None = None) -> dict:
    return {"kind": "roofline", "date": "2026-12-02T00:00:00", "model": "m", "machine": cpu,
            "decode": [{"dtype": d, "quantization": q, "batch": b, "context": c, "best_s": t} for d, q, b, c, t in cases],
            "prefill": [{"dtype": d, "quantization": q, "tokens": 100, "best_s": t} for (d, q), t in (prefill or {}).items()]}


def test_precision_advice_from_a_record(tmp_path):
    """The advice's arithmetic on records written by hand: int8 weight-only decodes faster at small batches and
    slower at 32; with prefill timed, a prompt-heavy job is faster unquantized."""
    info = machine_info()
    cpu = {"cpu": info["cpu"], "cores": info["cores"], "cpu_flags": info["cpu_flags"]}
    device = {"type": "cpu", **cpu}
    archive = tmp_path / "a.jsonl"
    cases = [("bfloat16", None, 1, 128, 0.010), ("bfloat16", None, 1, 1024, 0.012),
             ("bfloat16", "int8-weight-only", 1, 128, 0.006), ("bfloat16", "int8-weight-only", 1, 1024, 0.008),
             ("bfloat16", None, 32, 128, 0.030), ("bfloat16", "int8-weight-only", 32, 128, 0.045)]
    elsewhere = {**_record([(d, q, b, c, 1.0 if q else 0.001) for d, q, b, c, _ in cases],
                           {**cpu, "cores": cpu["cores"] + 64}), "date": "2026-12-03T00:00:00"}  # later, another CPU
    archive.write_text(json.dumps(_record(cases, cpu)) + "\n" + json.dumps(elsewhere) + "\n")

    small = advise_precision(archive, device, "bfloat16", None, decode_batch=3, prompt_tokens=0, output_tokens=300)
    assert small[0].startswith("precision: at the job's decode batch (~3; batch 1 measured)")
    assert small[1] == "  decode step bf16 int8 weight-only 7.0 ms, bf16 11.0 ms"  # the mean over the contexts
    assert small[2] == "  the job's decode (prefill not timed), estimated: bf16 int8 weight-only 2 s, bf16 3 s"
    assert small[3].startswith(f"  faster than the job's bf16: bf16 int8 weight-only ({11 / 7:.2f}x;")
    ratio = (0.010 / 0.006 * 0.012 / 0.008) ** 0.5  # decode steps: the geometric mean over the two contexts
    assert small[4] == (f"  int8-weight-only vs bf16, decode step: {ratio:.2f}x at batch 1, 0.67x at batch 32: "
                        f"faster at batch 1")
    large = advise_precision(archive, device, "bfloat16", None, 100, 0, 300)
    assert "batch 32 measured" in large[0] and large[3] == "  the job's bf16 is the fastest measured"

    timed = tmp_path / "timed.jsonl"  # prefill timed: 1 ms a prompt token unquantized, 3 ms with int8 weight-only
    timed.write_text(json.dumps(_record(cases, cpu, {("bfloat16", None): 0.1,
                                                     ("bfloat16", "int8-weight-only"): 0.3})) + "\n")
    prompt_heavy = advise_precision(timed, device, "bfloat16", None, 1, prompt_tokens=1000, output_tokens=300)
    assert prompt_heavy[2] == "  prefill bf16 1.00 ms, bf16 int8 weight-only 3.00 ms per prompt token"
    assert prompt_heavy[3] == "  the job's generation, estimated: bf16 4 s, bf16 int8 weight-only 5 s"
    assert prompt_heavy[4] == "  the job's bf16 is the fastest measured"

    assert advise_precision(archive, {**device, "cores": 999}, "bfloat16", None, 8, 0, 1) == []
    asked = advise_precision(archive, {**device, "cores": 999}, "bfloat16", "int8", 8, 0, 1)
    assert len(asked) == 1 and "--quantization none,int8-weight-only" in asked[0]


def test_w8a8_on_a_cpu_without_vnni_is_advised_against_in_the_plan(tmp_path):
    """On a CPU without int8 dot products (AVX2 only) the plan says W8A8 is slow there, record or not; with VNNI, or
    another quantization, it says nothing of it."""
    flags = {"avx2": True, "avx512f": False, "avx512_vnni": False, "avx_vnni": False, "amx_int8": False}
    avx2 = {"type": "cpu", "cpu": "AMD EPYC", "cores": 2, "cpu_flags": flags}
    lines = advise_precision(tmp_path / "none.jsonl", avx2, "float32", "int8", 8, 0, 1)
    assert lines[0].startswith("precision: this CPU lacks avx512_vnni/avx_vnni/amx_int8, so W8A8")
    assert "int8-weight-only with bfloat16" in lines[0] and len(lines) == 2  # and how to measure, with no record
    vnni = {**avx2, "cpu_flags": {**flags, "avx_vnni": True}}
    assert not any("lacks" in line for line in advise_precision(tmp_path / "none.jsonl", vnni, "float32", "int8",
                                                                8, 0, 1))
    assert advise_precision(tmp_path / "none.jsonl", avx2, "bfloat16", "int8-weight-only", 8, 0, 1)[0].startswith(
        "precision: no `batchgen bench --roofline` record")
    assert w8a8_slow_reason({"avx2", "fma"}) and w8a8_slow_reason({"avx2", "avx512_vnni"}) is None
    assert w8a8_slow_reason(set()) is None  # flags unknown: nothing said
