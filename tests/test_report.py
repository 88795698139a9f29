"""The job report (`_report.html`, written before `_SUCCESS`) and the run's timeline (`_timeline.json`): real runs of
the default model, each report rendered in headless Chromium (no console error, every chart drawn, the numbers the
output holds); `batchgen report` again and side by side; a killed run's timeline kept beside the resumed one's; the
side files batchgen's own in the output's checks; the timeline and the row sample bounded."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.job.output.final_rewrite import report_html
from batchgen.job.report import rows as report_rows
from batchgen.job.report.rows import ReportRows, error_reason
from batchgen.job.timeline import MAX_SAMPLES, Lane
from cli_runs import kill_after_parts, run_cli
from report_pages import render_report

ROOT = Path(__file__).resolve().parent.parent


def job_file(tmp_path: Path, name: str, base: str = "sample.yaml", **output) -> Path:
    job = yaml.safe_load((ROOT / "jobs" / base).read_text())
    job["input"]["path"] = str(ROOT / job["input"]["path"])
    job["output"] = {**job["output"], "path": str(tmp_path / name), **output}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def batchgen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """jobs/sample.yaml, run as a user runs it, with a price for tokens per dollar."""
    tmp = tmp_path_factory.mktemp("sample")
    done = run_cli(job_file(tmp, "out"), "--cost-per-hour", "2.5")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "out"


@pytest.fixture(scope="module")
def bad_rows(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bad_rows")
    done = run_cli(job_file(tmp, "out", "bad_rows.yaml"))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "out"


def test_the_sample_jobs_report_draws_every_chart_from_its_output(sample):
    summary = json.loads((sample / "_SUCCESS").read_text())
    shown, _ = render_report(sample / "_report.html")
    assert shown["health"]["rows"] == ["30"] and shown["health"]["error rows"] == ["0"]
    assert shown["health"]["output tokens per dollar"] == [f"{summary['tokens_per_dollar']:,.0f}"]
    ttft = pl.read_parquet(f"{sample}/*.parquet")["ttft_s"]
    number, unit = shown["health"]["time to first token p90"][0].split()  # "466 ms", "1.17 s"
    p90 = float(number) * {"ms": 1e-3, "s": 1.0, "min": 60.0}[unit]
    assert p90 == pytest.approx(float(ttft.quantile(0.9, "linear")), rel=0.01)
    assert shown["charts"]["throughput"]["series"] == ["engine"]  # one engine lane; the job's lane draws progress
    assert shown["charts"]["progress"]["series"] == ["job"]
    assert shown["charts"]["errors"]["empty"]  # no error rows: said, not drawn
    assert shown["charts"]["by_length"]["series"] == ["TTFT", "end to end"]
    assert [row[2] for row in shown["runs"]] == ["finished"]
    # _SUCCESS last; the side files' leading underscore keeps directory readers working
    assert (sample / "_SUCCESS").stat().st_mtime_ns >= (sample / "_report.html").stat().st_mtime_ns
    assert pq.read_table(sample).num_rows == pd.read_parquet(sample).shape[0] == 30


def test_the_by_length_chart_is_the_median_of_each_prompt_length_bin(sample):
    rows = ReportRows()
    rows.add(pq.read_table(sample))
    frame = pl.read_parquet(f"{sample}/*.parquet").with_columns(
        bin=pl.col("prompt_tokens").log(2).floor().cast(pl.Int64))
    expected = (frame.group_by("bin").agg(pl.col("prompt_tokens").median().alias("x"), pl.col("ttft_s").median(),
                                          pl.len().alias("rows"))
                .filter(pl.col("rows") >= 3).sort("bin"))
    assert expected.height >= 1
    got = rows.by_bins("ttft_s")
    want = list(zip(expected["x"], expected["ttft_s"], expected["rows"]))
    assert len(got) == len(want)
    for point, wanted in zip(got, want):  # pytest.approx takes no nested structure (pytest >= 9.2)
        assert point == pytest.approx(wanted)


def test_the_timeline_follows_the_run(sample):
    timeline = json.loads((sample / "_timeline.json").read_text())
    [run] = timeline["runs"]
    assert run["status"] == "finished" and run["rows_at_start"] == 0
    job, engine = run["lanes"]["job"]["columns"], run["lanes"]["engine"]
    assert job["rows_done"][0] == 0 and job["rows_done"][-1] == 30  # from the model's load to the last row
    assert job["t"] == sorted(job["t"]) and len(engine["columns"]["t"]) >= 3
    columns = engine["columns"]
    assert columns["results"][0] == 0 and columns["results"][-1] == 30  # the counters from zero: rates from the start
    assert columns["output_tokens"][-1] == json.loads((sample / "_SUCCESS").read_text())["output_tokens"]
    assert max(columns["running"]) > 1 and max(columns["kv_blocks_in_use"]) > 0 and columns["rss_bytes"][-1] > 2**27
    assert engine["constants"]["kv_pool_blocks"] > 0


def test_error_rows_are_counted_by_reason(bad_rows):
    shown, _ = render_report(bad_rows / "_report.html")
    errors = pl.read_parquet(f"{bad_rows}/*.parquet").filter(pl.col("finish_reason") == "error")["error"]
    expected = pd.Series([error_reason(e) for e in errors]).value_counts()
    bars = shown["charts"]["errors"]
    assert sorted(zip(bars["series"], map(int, bars["bars"]))) == sorted(expected.items())
    assert shown["health"]["error rows"] == [str(len(errors))]


def test_report_draws_two_outputs_side_by_side(sample, bad_rows, tmp_path):
    target = tmp_path / "both.html"
    done = batchgen("report", str(sample), str(bad_rows), "-o", str(target))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(target)
    shown, _ = render_report(target)
    assert shown["charts"]["ttft"]["series"] == [str(sample), str(bad_rows)]  # both end in /out: named by path
    assert shown["charts"]["throughput"]["series"] == [f"{sample} · engine", f"{bad_rows} · engine"]
    rows = shown["health"]["rows"]
    assert rows[0] == "30" and rows[1] == "12" and rows[2] == f"{12 / 30:.2f}x"  # each figure's ratio to the first's


def test_report_draws_one_output_again_and_refuses_an_unfinished_one(sample, tmp_path):
    page = sample / "_report.html"
    before = page.read_text()
    page.unlink()
    done = batchgen("report", str(sample))
    assert done.returncode == 0 and done.stdout.strip() == str(page), done.stderr
    assert page.read_text().split("<footer>")[0] == before.split("<footer>")[0]  # the same page, but its date
    assert not list(sample.glob(".*inprogress"))
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    refused = batchgen("report", str(unfinished))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"batchgen: error: output: {unfinished} holds no finished batchgen output (no _SUCCESS); the report draws "
        f"finished outputs (`batchgen status {unfinished}` tells how far a run is)")


@pytest.mark.slow
def test_a_killed_runs_timeline_is_kept_and_the_resumed_report_shows_both_runs(tmp_path):
    job = job_file(tmp_path, "out", rows_per_part=2)
    job_yaml = yaml.safe_load(job.read_text())
    job_yaml["engine"] = {**job_yaml.get("engine", {}), "max_num_seqs": 2}  # rows finish, and commit, one by one
    job.write_text(yaml.safe_dump(job_yaml))
    out = tmp_path / "out"
    kill_after_parts(job, out, 3)
    killed = json.loads((out / "_timeline.json").read_text())["runs"]
    assert [run["status"] for run in killed] == ["running"]  # as its first commit left it
    resumed = run_cli(job)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    runs = json.loads((out / "_timeline.json").read_text())["runs"]
    assert [run["status"] for run in runs] == ["running", "finished"]
    assert runs[1]["rows_at_start"] >= 2 and runs[1]["lanes"]["job"]["columns"]["rows_done"][-1] == 30
    assert runs[1]["started_unix"] > runs[0]["started_unix"]
    shown, _ = render_report(out / "_report.html")
    assert [row[2] for row in shown["runs"]] == ["running", "finished"]


def test_side_files_are_batchgens_only_with_its_mark(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "_report.html").write_text("<html>someone's report</html>")
    refused = run_cli(job_file(tmp_path, "out"))
    assert refused.returncode == 2 and "_report.html" in refused.stderr.splitlines()[-1], refused.stderr


def test_output_report_false_writes_no_report(tmp_path):
    done = run_cli(job_file(tmp_path, "out", report=False), "--set", "sampling.max_tokens=4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "out" / "_report.html").exists() and (tmp_path / "out" / "_timeline.json").exists()
    again = run_cli(job_file(tmp_path, "out"), "--set", "sampling.max_tokens=4", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "out" / "_report.html").exists()


def test_a_report_that_fails_to_draw_is_a_warning_not_the_jobs_failure(caplog):
    class Broken:
        def add(self, table):
            pass

        def html(self, summary):
            raise ValueError("no luck")

    assert report_html(Broken(), {}) is None
    assert "the job report was not written (ValueError: no luck)" in caplog.text


def test_a_lane_keeps_its_whole_span_in_max_samples():
    lane = Lane()
    for i in range(20 * MAX_SAMPLES):
        if lane.due(i * 0.25):
            lane.add(i * 0.25, {"results": i})
    t = lane.columns["t"]
    assert len(t) <= MAX_SAMPLES and t[0] == 0 and t[-1] >= (20 * MAX_SAMPLES - 1) * 0.25 - lane.interval_s
    assert lane.interval_s > 0.25 and lane.columns["results"] == [round(x / 0.25) for x in t]


def test_the_row_sample_is_bounded_and_exact_below_its_size(monkeypatch):
    monkeypatch.setattr(report_rows, "SAMPLE_ROWS", 100)
    rows = ReportRows()
    table = lambda n, start: pa.table({"ttft_s": [float(x) for x in range(start, start + n)],
                                       "finish_reason": ["stop"] * n, "error": pa.nulls(n, pa.string()),
                                       "prompt_tokens": [1] * n, "output_tokens": [2] * n, "cached_tokens": [0] * n})
    rows.add(table(60, 0))
    assert rows.to_json()["ttft_s"]["p50"] == pytest.approx(29.5)  # every row while there are fewer than 100
    for start in range(60, 10_000, 500):
        rows.add(table(500, start))
    assert rows.sampled == 100 and rows.rows == 60 + 500 * 20 and rows.tokens["output_tokens"] == 2 * rows.rows
    assert 2_000 < rows.to_json()["ttft_s"]["p50"] < 8_000  # a uniform sample: near the middle of 0..10,060
