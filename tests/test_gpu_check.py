"""The GPU check (batchgen/bench/gpu/): its dry run on the CPU end to end, a failing, crashing or overlong step
recorded while the next ones run, and its arithmetic (model shapes, decode-step floors, the workload, the greedy
rule)."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen.bench.gpu import check, steps
from batchgen.bench.gpu.orchestrate import run_steps
from batchgen.bench.gpu.shapes import MODEL_CONFIGS, ModelShape, decode_floor, decode_step_cost
from batchgen.bench.gpu.step_record import COMMON_KEYS, StepRecord, step_path
from batchgen.bench.greedy_check import greedy_verdict, is_near_tie
from batchgen.bench.workloads import random_token_rows

pytest.importorskip("triton")  # step 1's dry run runs a kernel test under the interpreter

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels")])}


def read(path: Path) -> dict:
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------- the dry run

def test_dry_run_writes_every_steps_json_with_its_keys(tmp_path):
    """`python -m batchgen.bench --gpu --dry-run`, as CI runs it from the checkout's root (step 1 runs its tests):
    every step on the CPU, each step's JSON with the common keys and its own, the summary and the closing table."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "batchgen.bench", "--gpu", "--dry-run", "--out-dir", str(out)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-4000:]
    for step in steps.STEPS:
        record = read(step_path(out, step.number, step.name))
        assert set(COMMON_KEYS) | set(step.keys) <= set(record), (step.name, sorted(record))
        assert record["ok"] and record["finished"] and record["error"] is None and record["mode"] == "dry-run"
        assert f"step {step.number} {step.name}" in done.stdout
    env, tests = read(out / "step0_environment.json"), read(out / "step1_kernel_tests.json")
    assert env["versions"]["torch"] == torch.__version__ and env["missing"] == {}
    assert env["git_commit"] == subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                               text=True).stdout.strip()
    # one kernel test ran under the interpreter; the CUDA-only ones were found by their names, and skipped
    assert tests["counts"]["passed"] >= 1 and tests["counts"]["skipped"] >= 4 and tests["returncode"] == 0
    assert {t["nodeid"].split("[")[0] for t in tests["tests"] if t["outcome"] == "skipped"} >= {
        n for n in tests["selection"]["tests"] if "::" in n}
    greedy, speed = read(out / "step2_greedy.json"), read(out / "step3_throughput.json")
    assert greedy["greedy_bf16"]["ok"] and greedy["greedy_fp32"]["ok"]
    assert greedy["engine_load"]["attention_kernels"] == "batchgen_kernels.reference"  # the dry run's torch backend
    assert speed["batchgen"]["finished"] == 10 and speed["batchgen"]["wrong_length"] == 0
    assert speed["hf_static"]["rows"] == 4 and speed["targets"]["speedup_vs_hf_static"] > 0
    assert set(speed["decode"]) == {"1", "4"} and speed["decode"]["4"]["ratio_to_floor"] > 0
    kv = speed["kv_int8"]  # the reference against itself in a dry run: the flow, not the kernels
    assert kv["ok"] and kv["store_identical"] and kv["int8_over_bf16"] > 0 and kv["int8_kv_bytes"] < kv["bf16_kv_bytes"]
    summary = read(out / "summary.json")
    assert summary["passed"] and [s["name"] for s in summary["steps"]] == [s.name for s in steps.STEPS]
    assert (out / "check.log").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_a_gpu_only_the_environment_step_runs_and_says_why(tmp_path):
    """The full check on a machine without CUDA: step 0 into $OUT (no --out-dir), naming what is missing; exit 2."""
    done = subprocess.run([sys.executable, "-m", "batchgen.bench", "--gpu", "--quick"], cwd=tmp_path,
                          env={**ENV, "OUT": str(tmp_path / "out")}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.json")) == ["step0_environment.json", "summary.json"]
    record = read(tmp_path / "out" / "step0_environment.json")
    assert record["finished"] and not record["ok"] and "a CUDA device" in record["missing"]


def test_away_from_a_checkout_step_1_is_skipped_saying_why(tmp_path, monkeypatch, capsys):
    """Run from another directory (as an installed batchgen always is), step 1 runs no tests, since they are the
    checkout's: its JSON and the closing table say it was skipped and why; no commit is recorded (no git is run)."""
    from batchgen.bench.checkout import checkout_root, git_commit
    from batchgen.bench.gpu.report import summary_table

    monkeypatch.chdir(tmp_path)
    assert checkout_root() is None and git_commit() is None
    code = check.main(["--dry-run", "--step", "kernel_tests", "--out-dir", str(tmp_path), "--work-dir",
                       str(tmp_path), "--step-budget", "60"])
    record = read(step_path(tmp_path, 1, "kernel_tests"))
    assert code == 0 and record["ok"] and record["finished"] and record["tests"] == []
    assert "not run from a batchgen checkout" in record["skipped"] and "skipped" in capsys.readouterr().err
    table = summary_table([record])
    assert "skip" in table.split()[3] and "not run from a batchgen checkout" in table
    monkeypatch.chdir(REPO)
    assert checkout_root() == REPO


# ------------------------------------------------------------------------------------------ failing steps

def test_a_step_that_raises_writes_its_error(tmp_path, monkeypatch):
    """The step's own process: the exception's type, message and traceback in its JSON, which is final."""
    def planted(args, record):
        record.phase("first", lambda: {"value": 1})
        raise RuntimeError("planted failure")

    monkeypatch.setitem(steps.STEP_BY_NAME, "greedy", replace(steps.STEP_BY_NAME["greedy"], run=planted))
    code = check.main(["--dry-run", "--step", "greedy", "--out-dir", str(tmp_path), "--work-dir", str(tmp_path),
                       "--step-budget", "60"])
    record = read(step_path(tmp_path, 2, "greedy"))
    assert code == 1 and record["finished"] and not record["ok"]
    assert record["error"] == "RuntimeError: planted failure" and "planted" in record["traceback"]
    assert record["first"] == {"value": 1}  # what ran before the error is kept


def test_a_phase_that_raises_fails_the_step_but_not_the_phases_after_it(tmp_path):
    record = StepRecord(tmp_path / "s.json", 3, "throughput", "dry-run", budget_s=60)
    record.phase("bad", lambda: 1 / 0)
    record.phase("good", lambda: {"x": 2})
    record.phase("4", lambda: [][1], group="decode")
    record.phase("late", lambda: {"x": 3}, min_s=1e9)  # not enough of the budget left: not run
    record.finish(ok=True)
    saved = read(tmp_path / "s.json")
    assert saved["bad"]["error"] == "ZeroDivisionError: division by zero" and saved["good"] == {"x": 2}
    assert saved["decode"]["4"]["error"].startswith("IndexError") and "skipped" in saved["late"]
    assert not saved["ok"] and saved["error"] == "failed: bad, decode/4" and saved["finished"]


def test_the_steps_after_a_failing_crashing_or_overlong_one_still_run(tmp_path):
    """The check itself: a real step that fails (its model cannot be saved: the work dir is a file), a process that
    dies before writing anything, one that dies halfway through its step and one past its budget each leave a JSON
    saying why; the environment step after them still runs."""
    out, blocked = tmp_path / "out", tmp_path / "not-a-dir"
    out.mkdir()
    blocked.write_text("")
    gpu = [sys.executable, "-m", "batchgen.bench.gpu", "--dry-run", "--out-dir", str(out)]
    halfway = (f"from batchgen.bench.gpu.step_record import StepRecord; import os, pathlib\n"
               f"r = StepRecord(pathlib.Path({str(out / 'step12_halfway.json')!r}), 12, 'halfway', 'dry-run', 60)\n"
               f"r.phase('done', lambda: 7)\nprint('about to crash', flush=True)\nos._exit(9)")
    commands = [
        (2, "greedy", gpu + ["--step", "greedy", "--work-dir", str(blocked), "--step-budget", "60"], 60.0),
        (11, "silent", [sys.executable, "-c", "print('no JSON from me'); raise SystemExit(3)"], 30.0),
        (12, "halfway", [sys.executable, "-c", halfway], 30.0),
        (13, "overlong", [sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(60)"], 2.0),
        (0, "environment", gpu + ["--step", "environment", "--work-dir", str(tmp_path), "--step-budget", "60"], 60.0),
    ]
    summary = {"steps": []}
    records = run_steps(commands, out, "dry-run", summary)
    greedy, silent, halfway_record, overlong, env = records
    assert greedy["finished"] and not greedy["ok"] and greedy["error"] == "failed: hf_model_bfloat16"
    assert "NotADirectoryError" in greedy["hf_model_bfloat16"]["error"]
    assert not silent["ok"] and silent["error"] == "its process exited with code 3 before the step's end"
    assert "no JSON from me" in silent["output_tail"]
    assert halfway_record["done"] == 7 and "code 9" in halfway_record["error"]
    assert "about to crash" in halfway_record["output_tail"]
    assert overlong["error"] == "stopped at its budget of 2 s" and overlong["wall_s"] < 30
    assert env["ok"] and env["finished"]
    for number, name, *_ in commands:  # each one's file says the same as the record returned
        assert read(step_path(out, number, name))["ok"] == (name == "environment")
    assert [s["ok"] for s in read(out / "summary.json")["steps"]] == [False, False, False, False, True]
    assert "sleeping" in (out / "check.log").read_text()


def test_the_check_imports_nothing_the_gpu_box_lacks():
    """Run as on the GPU box, with packages it may not have made unimportable: --help still works (it imports every
    step's module, the engine included). Step 1 alone needs pytest, which that box has."""
    blocked = ["psutil", "click", "pyarrow", "polars", "matplotlib", "gguf", "pytest"]
    # A None entry in sys.modules makes `import name` fail and importlib.util.find_spec(name) return None.
    code = (f"import sys, runpy\nsys.modules.update(dict.fromkeys({blocked!r}))\n"
            f"sys.argv = ['batchgen.bench', '--gpu', '--help']\nrunpy.run_module('batchgen.bench', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--quick" in done.stdout and "--dry-run" in done.stdout


def test_each_modes_budgets_fit_its_time_on_an_h200():
    """The full check in 8 minutes (a lent device allows 10 per command, its start included), --quick under 4."""
    assert sum(step.budget_s["full"] for step in steps.STEPS) <= 8 * 60
    assert sum(step.budget_s["quick"] for step in steps.STEPS) < 4 * 60


# ----------------------------------------------------------------------------------- the check's figures

def meta_parameter_count(config_kwargs) -> int:
    from transformers import LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config_kwargs))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("key, params", [("1b", 1_235_814_400), ("8b", 8_030_261_248)])
def test_model_shapes_count_the_parameters_of_the_real_models(key, params):
    shape = ModelShape.from_config(MODEL_CONFIGS[key])
    assert shape.num_params == params == meta_parameter_count(MODEL_CONFIGS[key])


def test_decode_step_cost_and_floor():
    shape = ModelShape.from_config(MODEL_CONFIGS["8b"])
    assert shape.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    one = decode_step_cost(shape, batch_size=1, total_context=1000)
    # Every weight once (the untied embedding: one row), 1000 tokens of K and V.
    assert one["weight_bytes"] == 2 * (8_030_261_248 - 128256 * 4096 + 4096)
    assert one["kv_bytes"] == 1000 * 131072
    assert one["matmul_flops"] == 2 * (8_030_261_248 - 128256 * 4096 - 65 * 4096)
    assert one["attention_flops"] == 4 * 32 * 32 * 128 * 1000
    floor = decode_floor(one, copy_bandwidth=4e12, matmul_rate=7e14)
    assert floor["bound"] == "memory" and floor["floor_s"] == pytest.approx(one["bytes"] / 4e12)
    assert floor["floor_s"] == pytest.approx(3.785e-3, rel=1e-3)  # 15.0 GB of weights, 0.13 GB of KV
    big = decode_step_cost(shape, batch_size=8192, total_context=8192)
    assert decode_floor(big, 4e12, 7e14)["bound"] == "compute"
    # The batch's KV scales with its total context; weights are read once whatever the batch.
    wide = decode_step_cost(shape, batch_size=256, total_context=256 * 1000)
    assert wide["kv_bytes"] == 256 * one["kv_bytes"] and wide["weight_bytes"] - one["weight_bytes"] == 255 * 4096 * 2
    tied = ModelShape.from_config(MODEL_CONFIGS["1b"])
    assert decode_step_cost(tied, 256, 1)["weight_bytes"] == decode_step_cost(tied, 1, 1)["weight_bytes"]


def test_synthetic_workload():
    def synthetic_workload(*args, seed):
        return [(row.token_ids, row.max_tokens) for row in random_token_rows(*args, seed=seed)]

    workload = synthetic_workload(300, (100, 1000), (100, 500), 128256, seed=3)
    assert len(workload) == 300
    assert all(100 <= len(p) <= 1000 and 100 <= m <= 500 and all(0 <= t < 128256 for t in p) for p, m in workload)
    assert min(len(p) for p, _ in workload) < 200 and max(len(p) for p, _ in workload) > 900
    assert workload == synthetic_workload(300, (100, 1000), (100, 500), 128256, seed=3)
    assert workload != synthetic_workload(300, (100, 1000), (100, 500), 128256, seed=4)


def test_greedy_verdict_and_the_bf16_near_tie_rule():
    assert is_near_tie(5.0, 4.95, rel_tol=2**-6, abs_tol=1e-3)  # within 0.079
    assert not is_near_tie(5.0, 4.85, rel_tol=2**-6, abs_tol=1e-3)
    assert not is_near_tie(5.0, 4.995, rel_tol=0.0, abs_tol=1e-3)  # fp32: the absolute 1e-3 alone
    references = [[1, 2, 3], [4, 5, 6]]
    logits = [torch.zeros(3, 10) for _ in references]
    logits[1][1, 5], logits[1][1, 9] = 3.0, 2.99  # prompt 1, step 1: tokens 5 and 9 nearly tie
    ok = greedy_verdict(references, logits, [[1, 2, 3], [4, 9, 0]], 2**-6, 1e-3, max_divergences=1)
    assert ok["ok"] and ok["identical"] == 1 and ok["divergences"][0]["step"] == 1
    assert not greedy_verdict(references, logits, [[1, 2, 3], [4, 9, 0]], 0.0, 1e-3, 1)["ok"]
    logits[1][1, 9] = 1.0  # no longer a tie
    assert not greedy_verdict(references, logits, [[1, 2, 3], [4, 9, 0]], 2**-6, 1e-3, 1)["ok"]
    assert not greedy_verdict(references, logits, [[1, 2], [4, 5, 6]], 2**-6, 1e-3, 1)["ok"]  # stopped early
