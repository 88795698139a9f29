"""Resume: a real `kill -9` of the CLI mid-run, then the same command again -> every row exactly once and the
rows committed before the kill not generated again; a changed job is refused; a failure commits what finished;
a crash inside the final rewrite is finished on the next run; one run per output at a time."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.request import Result
from batchgen.job import load_job, prepare_job
from batchgen.job.executors import local
from batchgen.job.output import output_dir as sink_module
from batchgen.job.config import ROW_COLUMN
from batchgen.job.output.part_writer import PartWriter
from batchgen.job.prepare import fingerprint_text

SYSTEM = "You are a friendly tutor. Answer the student's question in two or three sentences, simply and kindly."
TOPICS = ["volcanoes", "photosynthesis", "fractions", "the moon", "rainbows", "magnets", "bees", "tides",
          "clouds", "gravity", "seasons", "deserts", "fossils", "earthquakes", "the heart", "electricity",
          "rivers", "glaciers", "bats", "coral reefs"]


def run_cli(job: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), *args], capture_output=True,
                          text=True, timeout=600)


def make_job(root: Path, rows: int, **sections) -> Path:
    table = pa.table({"qid": [f"q{i:03d}" for i in range(rows)],
                      "prompt": [f"Why do we have {TOPICS[i % len(TOPICS)]}? (question {i})" for i in range(rows)]})
    pq.write_table(table, root / "in.parquet")
    job = {
        "model": "default",
        "input": {"path": str(root / "in.parquet"), "id_column": "qid", "system_prompt": SYSTEM},
        "sampling": {"max_tokens": 16},
        "engine": {"max_num_seqs": 2, "max_num_batched_tokens": 256, "kv_cache_memory": "64MiB"},
        "output": {"path": str(root / "out"), "rows_per_part": 2},
    }
    for key, value in sections.items():
        job[key] = {**job[key], **value}
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_parts(out: Path) -> list[Path]:
    return sorted(out.glob("run-*.parquet"))


def committed_rows(out: Path) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(p) for p in run_parts(out)])


@pytest.mark.slow
def test_kill_9_then_rerun_finishes_every_row_once(tmp_path):
    rows = 16
    job = make_job(tmp_path, rows, sampling={"max_tokens": 12}, engine={"max_num_seqs": 4})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(run_parts(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = time.time()
    assert proc.returncode == -signal.SIGKILL

    assert not (out / "_SUCCESS").exists()
    # nothing half-written in the output: the run parts, and the timeline as the first commit saved it
    assert all(p.name.startswith("run-") or p.name == "_timeline.json" for p in out.iterdir())
    before = committed_rows(out)
    # 2 parts: of 2 rows each, or fewer where a row took more than the 60 s commit interval (a loaded machine)
    assert len(run_parts(out)) >= 2 and 2 <= before.height < rows
    assert before["id"].n_unique() == before.height

    # a changed job is refused and touches nothing (in process: the refusal comes before the model loads)
    snapshot = {p.name: p.read_bytes() for p in run_parts(out)}
    for change, what in [("sampling.max_tokens=8", "sampling"), ("input.system_prompt=Be terse.", "input"),
                         ("dtype=float16", "dtype")]:
        refused = CliRunner().invoke(main, ["run", str(job), "--set", change])
        assert refused.exit_code == 2, refused.output
        assert f"holds rows of a different job ({what} changed)" in refused.stderr
    assert {p.name: p.read_bytes() for p in run_parts(out)} == snapshot

    # the same job (engine settings may change: they do not change results) resumes
    resumed = run_cli(job, "--set", "engine.max_num_seqs=8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = pl.read_parquet(f"{out}/*.parquet")
    assert final["id"].to_list() == [f"q{i:03d}" for i in range(rows)]  # every row once, input order
    assert ROW_COLUMN not in final.columns
    assert sorted(p.name for p in out.iterdir())[0] == "_SUCCESS" and not (tmp_path / ".out.batchgen-tmp").exists()

    # rows committed before the kill were kept as they were, the rest generated after it
    kept = final.join(before.select("id", "text", "arrival_time", "finish_time"), on="id", suffix="_before")
    assert kept.height == before.height
    assert kept["text"].to_list() == kept["text_before"].to_list()
    assert kept["finish_time"].to_list() == kept["finish_time_before"].to_list()
    fresh = final.filter(~pl.col("id").is_in(before["id"].to_list()))
    assert fresh.height == rows - before.height
    assert all(t.timestamp() >= killed_at for t in fresh["arrival_time"].to_list())

    summary = json.loads((out / "_SUCCESS").read_text())
    assert summary["resumed"] is True and summary["rows_this_run"] == rows - before.height
    assert summary["rows"] == rows and summary["output_tokens"] == final["output_tokens"].sum()

    again = CliRunner().invoke(main, ["run", str(job)])
    assert again.exit_code == 0 and "already complete" in again.stderr


# -- without the model: the ledger alone decides what is left --------------------------------------------------------

def fake_result(row: int) -> Result:
    t = 1_700_000_000.0 + row
    return Result(request_id=row, text=f"committed {row}", token_ids=[1, 2], finish_reason="length", error=None,
                  prompt_tokens=5, output_tokens=2, cached_tokens=0, num_preemptions=0, arrival_time=t,
                  first_scheduled_time=t, first_token_time=t + 0.1, finish_time=t + 0.2)


def commit_all_rows(job_path: Path, rows: int, *, order=None, rows_per_part: int = 2,
                    sort_by_row: bool = True) -> None:
    """What an earlier run had committed when it died: every row (or those of `order`, in that order), in part
    files; sort_by_row=False as a run with `output.order: completion` writes them."""
    prepared = prepare_job(load_job(job_path))
    writer = PartWriter(prepared.out, prepared.schema, fingerprint_text(prepared.fingerprint), rows_per_part, 60.0,
                        sort_by_row)
    for row in order or range(rows):
        writer.add(row, f"q{row:03d}", (), fake_result(row))
    writer.commit()
    prepared.release()


def test_all_rows_committed_finishes_without_generating(tmp_path):
    job = make_job(tmp_path, 5)
    commit_all_rows(job, 5, order=[3, 1, 4, 0, 2])
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.output
    final = pl.read_parquet(f"{tmp_path / 'out'}/*.parquet")
    assert final["text"].to_list() == [f"committed {i}" for i in range(5)]


def test_crash_in_final_rewrite_is_finished_by_the_next_run(tmp_path, monkeypatch):
    job = make_job(tmp_path, 5)
    commit_all_rows(job, 5)
    real_replace = os.replace
    calls = []

    def crash_on_first_final_move(src, dst):
        if Path(src).parent.name == "final" and Path(dst).name.startswith("part-"):
            calls.append(dst)
            raise OSError("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(sink_module.os, "replace", crash_on_first_final_move)
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 1 and "runtime failure: OSError: power cut" in result.stderr
    assert calls and not (tmp_path / "out" / "_SUCCESS").exists()
    monkeypatch.undo()
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.output
    final = pl.read_parquet(f"{tmp_path / 'out'}/*.parquet")
    assert final["id"].to_list() == [f"q{i:03d}" for i in range(5)]
    assert final["text"].to_list() == [f"committed {i}" for i in range(5)]


def test_runtime_failure_exits_1_and_keeps_what_finished(tmp_path, monkeypatch):
    """The real engine, stopped by a failure after three results: those three are committed."""
    job = make_job(tmp_path, 6, sampling={"max_tokens": 4}, engine={"max_num_seqs": 6}, output={"rows_per_part": 100})
    real_load = local.load_engine

    class FailingAfterThree:
        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):  # the engine's tokenizer, limits, ...
            return getattr(self.engine, name)

        def generate(self, requests, on_step=None):
            for n, result in enumerate(self.engine.generate(requests, on_step)):
                if n == 3:
                    raise RuntimeError("device lost")
                yield result

    monkeypatch.setattr(local, "load_engine", lambda prepared: FailingAfterThree(real_load(prepared)))
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 1
    assert "runtime failure: RuntimeError: device lost" in result.stderr and "re-run" in result.stderr
    out = tmp_path / "out"
    assert committed_rows(out).height == 3 and not (out / "_SUCCESS").exists()


def test_one_run_per_output_at_a_time(tmp_path):
    job = make_job(tmp_path, 2)
    holder = prepare_job(load_job(job))  # holds the output's lock, as a running job would
    try:
        result = CliRunner().invoke(main, ["run", str(job)])
        assert result.exit_code == 75 and "another batchgen run is writing" in result.stderr
    finally:
        holder.release()


def test_overwrite_discards_committed_rows(tmp_path):
    job = make_job(tmp_path, 3)
    commit_all_rows(job, 3)
    prepared = prepare_job(load_job(job, ["sampling.max_tokens=3"]), overwrite=True)
    prepared.release()
    assert list((tmp_path / "out").iterdir()) == []


# -- found by probing crashes and resumes ----------------------------------------------------------------------------

def test_completion_order_parts_finish_in_input_order(tmp_path):
    """A run with order: completion died after committing everything; the re-run asks for input order (order may
    differ between runs). Every row once, in input order: the final rewrite must not assume sorted parts."""
    order = [5, 0, 3, 7, 1, 6, 2, 8, 4]
    job = make_job(tmp_path, 9, output={"rows_per_part": 2})
    commit_all_rows(job, 9, order=order, rows_per_part=3, sort_by_row=False)
    assert [pq.read_table(p)["_row"].to_pylist() for p in run_parts(tmp_path / "out")] == [[5, 0, 3], [7, 1, 6],
                                                                                            [2, 8, 4]]
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.output
    table = pl.read_parquet(tmp_path / "out" / "*.parquet")
    assert table["id"].to_list() == [f"q{row:03d}" for row in range(9)]
    assert table["text"].to_list() == [f"committed {row}" for row in range(9)]
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["rows"] == 9


def test_a_failure_while_writing_success_leaves_nothing_in_the_output(tmp_path, monkeypatch):
    """A full disk (or a crash) while _SUCCESS is written: its half-written scratch is not in output.path, so the
    re-run finishes the job instead of refusing a file it does not know."""
    job = make_job(tmp_path, 4)
    commit_all_rows(job, 4)
    real_fsync = sink_module._fsync

    def disk_full(path):
        if path.name == "_SUCCESS.inprogress":
            raise OSError(28, "No space left on device")
        real_fsync(path)

    monkeypatch.setattr(sink_module, "_fsync", disk_full)
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 1 and "No space left on device" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["_report.html", "_timeline.json",
                                                                    "part-00000.parquet", "part-00001.parquet"]
    monkeypatch.setattr(sink_module, "_fsync", real_fsync)
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["rows"] == 4


def test_a_success_scratch_left_by_an_older_version_is_batchgens(tmp_path):
    job = make_job(tmp_path, 3)
    commit_all_rows(job, 3)
    (tmp_path / "out" / "_SUCCESS.inprogress").write_text('{"rows": ')
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert not (tmp_path / "out" / "_SUCCESS.inprogress").exists()
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["rows"] == 3


def test_a_run_that_finished_while_this_one_took_the_lock_is_not_redone(tmp_path, monkeypatch):
    """Overlapping runs: B checks the output while A still runs, A finishes (and removes the temp directory, lock
    and all), then B locks. B must see the finished job, not start it again over A's parts."""
    job = make_job(tmp_path, 4)
    commit_all_rows(job, 4)
    real_lock = sink_module.lock_output

    def lock_after_the_other_run_finished(out):
        finished = run_cli(job, "--quiet")  # "A": finalizes the committed rows
        assert finished.returncode == 0, finished.stderr
        return real_lock(out)

    monkeypatch.setattr(sink_module, "lock_output", lock_after_the_other_run_finished)
    prepared = prepare_job(load_job(job))
    assert prepared.complete is not None and prepared.complete["rows"] == 4 and prepared.out.lock_fd is None
    assert not (tmp_path / ".out.batchgen-tmp").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["_SUCCESS", "_report.html", "_timeline.json",
                                                                   "part-00000.parquet", "part-00001.parquet"]


def test_max_model_len_is_part_of_the_job(tmp_path):
    """A shorter context cuts rows short: resuming under another max_model_len would mix rows of both."""
    job = make_job(tmp_path, 4)
    commit_all_rows(job, 4, order=[0, 1])
    result = CliRunner().invoke(main, ["run", str(job), "--quiet", "--set", "engine.max_model_len=42"])
    assert result.exit_code == 2
    assert "holds rows of a different job (max_model_len changed)" in result.stderr


EARLY_SIGTERM = """
import os, signal, sys, time
import batchgen.job
from batchgen.cli import main

def prepare_job(config, overwrite=False):
    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's kill while the input is still being checked
    time.sleep(30)

batchgen.job.prepare_job = prepare_job
main(sys.argv[1:])
"""


def test_sigterm_before_the_model_loads_exits_130_with_the_error_line(tmp_path):
    job = make_job(tmp_path, 2)
    proc = subprocess.run([sys.executable, "-c", EARLY_SIGTERM, "run", str(job), "--quiet"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines()[-1].startswith("batchgen: error: interrupted")
