"""`batchgen bench` options: --dtype / --hf-dtype (each system runs in, and records, its dtype) and the vLLM worker's
OMP thread binding (--vllm-threads-bind), through a stand-in worker that reports what it was given."""
from __future__ import annotations

import json
import os
import stat
import sys
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from batchgen.bench import ceiling, vllm_system
from batchgen.bench.system_types import BenchOptions
from batchgen.cli import main
from batchgen.engine import EngineArgs

FAKE_WORKER = """
import json, os, sys
in_path, out_path = sys.argv[2], sys.argv[3]
spec = json.load(open(in_path))
bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
print("INFO 11-30 [ompmultiprocessing.py:180] OpenMP thread binding info: ")
print(f"\\tVLLM_CPU_OMP_THREADS_BIND={bind or 'auto'!r}, auto_setup={bind is None}, skip_setup=False")
print("\\tlocal_rank=0, core ids=[0]")
print("\\treserved_cpus=[1]")
print("INFO something else")
rows = [{"id": r["id"], "token_ids": r["prompt_token_ids"][:r["max_tokens"]], "num_cached_tokens": 0,
         "first_token_s": 0.01, "finish_s": 0.02} for r in spec["rows"]]
json.dump({"vllm_version": "fake " + spec["dtype"] + " " + str(bind), "load_s": 0.1, "wall_s": 0.2, "rows": rows},
          open(out_path, "w"))
"""


@pytest.fixture
def fake_vllm_python(tmp_path):
    """An executable that runs the stand-in worker with this Python, as --vllm-python runs vllm_worker.py."""
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake_worker.py'} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return str(python)


def test_cpu_list_and_threads_bind():
    assert vllm_system.cpu_list({8, 0, 1, 2, 5, 7}) == "0-2,5,7-8"
    assert vllm_system.cpu_list([3]) == "3"
    assert vllm_system.threads_bind("all") == vllm_system.cpu_list(os.sched_getaffinity(0))
    assert vllm_system.threads_bind("default") is None
    assert vllm_system.threads_bind("0,2-3") == "0,2-3"


@pytest.mark.parametrize("setting", ["all", "default", "0"])
def test_vllm_worker_gets_the_dtype_and_the_bind_setting(tiny_llama_dir, fake_vllm_python, monkeypatch, setting):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "9")  # the caller's own value never leaks through
    rows = [SimpleNamespace(id=i, token_ids=[5, 6, 7, 8], max_tokens=2) for i in range(3)]
    options = BenchOptions(EngineArgs(model=str(tiny_llama_dir)), vllm_python=fake_vllm_python, dtype="bfloat16",
                           vllm_threads_bind=setting)
    run = vllm_system.run(rows, options)
    assert run.available, run.reason
    expected = {"all": vllm_system.cpu_list(os.sched_getaffinity(0)), "default": None, "0": "0"}[setting]
    assert run.details["vllm_version"] == f"fake bfloat16 {expected}"  # what the worker saw
    assert run.details["dtype"] == "bfloat16"
    assert run.details["omp_threads_bind"] == (expected if expected else "vLLM's default")
    log = run.details["omp_binding_log"]
    assert log[0].endswith("OpenMP thread binding info:") and log[-1] == "reserved_cpus=[1]" and len(log) == 4
    assert [row.token_ids for row in run.rows] == [[5, 6]] * 3


@pytest.mark.slow
def test_bench_records_each_systems_dtype(tmp_path, monkeypatch):
    # The machine's bf16 ceiling at 256 x 256, not 2,048: on a CPU without native bf16 torch's bf16 matmul runs at
    # well under a GFLOP/s, and six 2,048-cube ones took most of this test's minutes.
    matmul_flops = ceiling.matmul_flops
    monkeypatch.setattr(ceiling, "matmul_flops", lambda n, dtype: matmul_flops(256, dtype=dtype))
    out, archive = tmp_path / "out", tmp_path / "archive.jsonl"
    result = CliRunner().invoke(main, ["bench", "--workload", "labeling", "--rows", "2", "--max-tokens-scale", "0.25",
                                       "--systems", "batchgen,hf-static", "--hf-batch-sizes", "2", "--dtype",
                                       "bfloat16", "--hf-dtype", "float32", "--out", str(out), "--archive",
                                       str(archive)])
    assert result.exit_code == 0, result.output
    record = json.loads(next(out.glob("*.json")).read_text())
    assert record["config"]["engine_args"]["dtype"] == "bfloat16" and record["ceiling"]["dtype"] == "bfloat16"
    assert record["systems"]["batchgen"]["dtype"] == "bfloat16" and record["systems"]["hf-static"]["dtype"] == "float32"
    assert record["comparisons"]["hf-static"]["dtype"] == "float32"
    assert record["comparisons"]["hf-static"]["reference_dtype"] == "bfloat16"
    assert {"avx2", "avx512_bf16", "amx_bf16"} <= record["machine"]["cpu_flags"].keys()
    lines = result.output.splitlines()
    assert any(line.startswith("batchgen ") and " bf16 " in line for line in lines)
    assert any(line.startswith("hf-static (B=2) ") and " fp32 " in line for line in lines)
    assert "bf16 256x256 matmul" in result.output
    history = CliRunner().invoke(main, ["bench", "--history", "--archive", str(archive)])
    assert "bf16" in history.output and "fp32" in history.output


def test_bad_dtype_exits_2(tmp_path):
    result = CliRunner().invoke(main, ["bench", "--dtype", "float64", "--archive", str(tmp_path / "a.jsonl")])
    assert result.exit_code == 2 and "float64" in result.output
