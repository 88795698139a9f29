"""executor.kind: ray on a local Ray (this machine's 2 CPUs): 2 replicas of the default model, 1 thread each. The
output equals the local executor's, error rows included; a replica killed with SIGKILL mid-run and a driver killed
mid-run both end with every row exactly once; job errors behave as in local runs.

The Ray runs share one small input: 12 short prompts of jobs/sample.yaml's file, then the 12 rows of
data/samples/bad_rows.parquet (7 unusable, 5 with per-row temperature or max_tokens), at 20 tokens at most: what
they guard (rows mapped back, written once, in input order; per-row sampling; error rows) shows on a few short rows,
and each window's decode steps cost the replica's single thread in proportion to max_tokens."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import psutil
import pytest
import yaml

import ray  # noqa: F401 -- the `ray` extra is part of the test setup: a missing Ray fails here, not silently

from batchgen.machine import cpu_flags
from cli_runs import read, run_cli
from ray_processes import processes_under
from report_pages import render_report

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = yaml.safe_load((ROOT / "jobs" / "sample.yaml").read_text())
COMPARED = ["id", "text", "finish_reason", "error", "prompt_tokens", "output_tokens", "topic"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """The module's input (see the docstring): ids as strings, the bad rows' topic null, the sample rows'
    temperature null."""
    good = pl.read_parquet(ROOT / "data" / "samples" / "prompts.parquet")
    good = good.filter(pl.col("prompt").str.len_chars() < 100).head(12).with_columns(pl.col("id").cast(pl.String))
    bad = pl.read_parquet(ROOT / "data" / "samples" / "bad_rows.parquet")
    path = tmp_path_factory.mktemp("input") / "prompts.parquet"
    pl.concat([good, bad], how="diagonal").write_parquet(path)
    return path


def write_job(tmp_path: Path, name: str, executor: dict | None, prompts: Path | None = None,
              batch_invariant: bool = False, dtype: str = "bfloat16", quantization: str | None = None,
              **output) -> Path:
    """jobs/sample.yaml on `prompts` at 20 tokens (on its own file without `prompts`); in fp32 (bf16 greedy can
    break a near-tie differently in another batch or cache state), or with `batch_invariant` in `dtype` (and
    `quantization`)."""
    job = json.loads(json.dumps(SAMPLE))
    job["dtype"] = dtype if batch_invariant else "float32"
    if batch_invariant:
        job.setdefault("engine", {})["batch_invariant"] = True
        if quantization:
            job["engine"]["quantization"] = quantization
    job["input"]["path"] = str(prompts or ROOT / job["input"]["path"])
    job["sampling"]["max_tokens"] = 20
    job["output"] = {**job["output"], "path": str(tmp_path / name), **output}
    if executor is not None:
        job["executor"] = {"kind": "ray", "replicas": 2, "cpus_per_replica": 1, **executor}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def session_processes(driver: int) -> list[psutil.Process]:
    """The processes of the local Ray that the `batchgen run` with pid `driver` started (its head: gcs_server,
    raylet, ...: their command lines name the session directory, which ends in the driver's pid) and all their
    descendants (the workers, the replicas). Other Ray sessions on the machine are left alone."""
    return processes_under(lambda cmdline: "/ray/session_" in cmdline
                           and f"_{driver}/" in cmdline.split("/ray/session_", 1)[-1])


def kill_ray_left_behind(driver: int) -> None:
    """A driver killed with SIGKILL leaves its local Ray running: stop it, as an operator would (`ray stop`)."""
    for process in session_processes(driver):
        try:
            process.kill()
        except psutil.Error:
            pass


def wait_for_parts(out: Path, count: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while len(list(out.glob("run-*.parquet"))) < count and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before the kill: {proc.stderr.read()[-3000:]}"


def kill_driver_after_parts(job: Path, out: Path, parts: int) -> None:
    """Run the job until it has committed `parts` run parts, then SIGKILL its driver (and stop its local Ray)."""
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_parts(out, parts, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        kill_ray_left_behind(proc.pid)


@pytest.fixture(scope="module")
def local(tmp_path_factory, prompts) -> pl.DataFrame:
    tmp = tmp_path_factory.mktemp("local")
    done = run_cli(write_job(tmp, "out", None, prompts))
    assert done.returncode == 0, done.stderr[-3000:]
    return read(tmp / "out")


@pytest.mark.slow
def test_ray_output_equals_the_local_executors(tmp_path, prompts, local):
    """Row for row, error rows included (as test_cli_e2e's local run of bad_rows.parquet has them), in windows of
    the default size (24 rows over 2 replicas: 8 windows of 3)."""
    done = run_cli(write_job(tmp_path, "out", {}, prompts))
    assert done.returncode == 0, done.stderr[-3000:]
    # --quiet: nothing of Ray's Python warnings either; Ray 2.60's core worker still logs one line for every Ray Data
    # actor pool (ray-project/ray#57733), which no Python logging setting reaches.
    assert done.stdout == ""
    assert all("core_worker.cc" in line for line in done.stderr.splitlines()), done.stderr[-3000:]
    ours = read(tmp_path / "out")
    assert ours.select(COMPARED).equals(local.select(COMPARED))  # same texts, counts, ids, input order, errors
    assert ours.filter(pl.col("finish_reason") == "error").height >= 5
    assert [c for c in ours.columns if c != "replica"] == local.columns and "replica" in ours.columns
    assert sorted(ours["replica"].unique().to_list()) == [0, 1]  # both replicas served rows
    summary = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert set(summary["replicas"]) == {"0", "1"}
    assert sum(r["rows"] for r in summary["replicas"].values()) == summary["rows"] == local.height
    assert sum(r["output_tokens"] for r in summary["replicas"].values()) == summary["output_tokens"]
    assert all(r["wall_s"] > 0 and r["engine_stats"]["num_steps"] > 0 for r in summary["replicas"].values())
    # the report: a lane per replica, from the stats each sends with its results; a row per replica in its table
    shown, _ = render_report(tmp_path / "out" / "_report.html")
    assert sorted(shown["charts"]["throughput"]["series"]) == ["replica 0", "replica 1"]
    assert sorted(shown["charts"]["kv"]["series"]) == ["replica 0", "replica 1"]
    assert shown["charts"]["ttft"]["series"] == ["all rows", "replica 0", "replica 1"]
    assert [row[2] for row in shown["replicas"]] == [str(summary["replicas"][r]["rows"]) for r in ("0", "1")]


@pytest.mark.slow
def test_a_replica_killed_mid_run_loses_and_repeats_nothing(tmp_path, prompts, local):
    job = write_job(tmp_path, "out", {"batch_size": 3}, prompts, rows_per_part=2)
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_parts(tmp_path / "out", 2, proc)
    replicas = [p for p in session_processes(proc.pid) if "EngineReplica" in " ".join(p.cmdline())]
    assert replicas, "no replica process found"
    replicas[0].send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    ours = read(tmp_path / "out")
    assert ours.select(COMPARED).equals(local.select(COMPARED))  # every row once, the same texts
    assert ours["replica"].max() >= 2  # the restarted replica took a new number


@pytest.mark.slow
def test_a_driver_killed_mid_run_resumes_with_every_row_once(tmp_path, prompts, local):
    job = write_job(tmp_path, "out", {"batch_size": 3}, prompts, rows_per_part=2)
    out = tmp_path / "out"
    kill_driver_after_parts(job, out, 2)
    committed = pl.concat([pl.read_parquet(p) for p in out.glob("run-*.parquet")])
    assert 0 < committed.height < local.height and committed["_row"].is_unique().all()
    resumed = run_cli(job)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours = read(out)
    assert ours.select(COMPARED).equals(local.select(COMPARED))
    summary = json.loads((out / "_SUCCESS").read_text())
    assert summary["resumed"] and summary["rows_this_run"] == local.height - committed.height
    runs = json.loads((out / "_timeline.json").read_text())["runs"]  # the killed run's timeline, as last saved
    assert [run["status"] for run in runs] == ["running", "finished"]


# Two modes across replicas (bf16, whose rows change with their batch by default, and fp32 W8A8's int8 kernels);
# tests/test_batch_invariance.py holds every mode to the same bits in-process.
INVARIANT_MODES = [("bfloat16", None), ("float32", "int8")]
VNNI = bool({"avx512_vnni", "avx_vnni", "amx_int8"} & (cpu_flags() or set()))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,quantization", INVARIANT_MODES, ids=[f"{d}-{q or 'plain'}" for d, q in INVARIANT_MODES])
def test_batch_invariant_on_ray_killed_and_resumed_equals_one_local_run(tmp_path, prompts, dtype, quantization):
    """README, "Determinism": a batch-invariant job run on 2 one-thread Ray replicas in windows of 3 rows, its
    driver killed with SIGKILL after 2 parts and the job resumed, gives every row exactly the local run's text (one
    2-thread engine, all rows in one batch) — in bf16, where rows do change with their batch by default, too."""
    if quantization == "int8" and not VNNI:  # tests/test_batch_invariance.py covers W8A8 in-process everywhere
        pytest.skip("W8A8 without VNNI (torch._int_mm at ~6 GFLOP/s) would take minutes a run")
    mode = dict(batch_invariant=True, dtype=dtype, quantization=quantization)
    local_done = run_cli(write_job(tmp_path, "local", None, prompts, **mode))
    assert local_done.returncode == 0, local_done.stderr[-3000:]
    local = read(tmp_path / "local")
    job = write_job(tmp_path, "out", {"batch_size": 3}, prompts, rows_per_part=2, **mode)
    out = tmp_path / "out"
    kill_driver_after_parts(job, out, 2)
    resumed = run_cli(job)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours = read(out)
    assert json.loads((out / "_SUCCESS").read_text())["resumed"]
    assert ours.select(COMPARED).equals(local.select(COMPARED))


def test_a_local_ray_that_misses_its_startup_wait_is_started_again(monkeypatch):
    """Ray waits a fixed 30 s for a local raylet; on a loaded machine the first start can miss it (seen in CI).
    connect() starts it once more; a cluster address, or any other error, is raised as it is."""
    from batchgen.job.executors import ray as executor

    calls, stops = [], []

    def init(**kwargs):
        calls.append(kwargs["address"])
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: stops.append(1))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert executor.connect(None) and calls == [None, None] and stops == [1]
    calls.clear()
    with pytest.raises(Exception, match="timed out during startup"):
        executor.connect("10.0.0.1:6379")  # a cluster that is not up: its error, at once
    assert calls == ["10.0.0.1:6379"]


def test_job_errors_exit_2_before_anything_starts(tmp_path):
    bad = run_cli(write_job(tmp_path, "out", {"replicas": 0}))
    assert bad.returncode == 2 and "executor.replicas: must be at least 1" in bad.stderr
    job = write_job(tmp_path, "out", {})
    hide = "import sys; sys.modules['ray'] = None; from batchgen.cli import main; main()"
    missing = subprocess.run([sys.executable, "-c", hide, "plan", str(job)], capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 2 and "pip install -e \".[ray]\" in batchgen's checkout" in missing.stderr
    assert not (tmp_path / "out").exists()


def test_windows_cover_every_row_not_committed_once(tmp_path):
    """The replicas' windows, read across files and row groups, give exactly the rows a local run reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.job.config import parse_job
    from batchgen.job.input.files import inspect_input
    from batchgen.job.executors.ray import plan_windows
    from batchgen.job.input.source import PromptBuilder, read_source, read_window
    from batchgen.models.loader import load_tokenizer, resolve_model

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(7)]}), tmp_path / "in" / "a.parquet", row_group_size=3)
    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(7, 12)]}), tmp_path / "in" / "b.parquet",
                   row_group_size=2)
    config = parse_job({"input": {"path": str(tmp_path / "in"), "sort": "none"}, "output": {"path": "out"}})
    inputs, tokenizer = inspect_input(config), load_tokenizer(resolve_model("default"))
    done = bytearray(12)
    done[5] = done[8] = done[9] = done[10] = done[11] = 1
    windows = plan_windows(done, 4)
    assert [(w["start"], w["stop"]) for w in windows] == [(0, 4), (4, 8)]  # rows 8-11 are all committed
    builder = PromptBuilder(config, inputs, tokenizer, 2048)
    read = [(r.row, r.token_ids) for w in windows
            for r in read_window(config, inputs, builder, w["start"], w["stop"], w["done"])]
    assert read == [(r.row, r.token_ids) for r in read_source(config, inputs, tokenizer, 2048, done)]
    assert [row for row, _ in read] == [0, 1, 2, 3, 4, 6, 7]
