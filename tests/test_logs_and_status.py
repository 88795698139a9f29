"""Runs nobody watches (README, "Logs and status"): with stderr to a file, a progress line every
--progress-interval seconds; with --log-format json, every stderr line one JSON object (progress, the summary, the
error); `batchgen status` from a second process on a running job and on a finished one, its rows those of the
ledger."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import polars as pl
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = yaml.safe_load((ROOT / "jobs" / "sample.yaml").read_text())


def write_job(tmp_path: Path, max_num_seqs: int = 8, **output) -> Path:
    job = json.loads(json.dumps(SAMPLE))
    job["input"]["path"] = str(ROOT / "data" / "samples" / "prompts.parquet")
    job["sampling"]["max_tokens"] = 16
    job["engine"]["max_num_seqs"] = max_num_seqs
    job["output"] = {**job["output"], "path": str(tmp_path / "out"), **output}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def batchgen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True, timeout=600)


def committed_rows(out: Path) -> int:
    parts = sorted(out.glob("run-*.parquet"))
    return pl.concat([pl.read_parquet(p) for p in parts])["_row"].n_unique() if parts else 0


def test_status_of_a_running_job_and_a_finished_one_matches_the_ledger(tmp_path):
    job, out, stderr = write_job(tmp_path, max_num_seqs=2, rows_per_part=2, commit_interval_s=0.2), tmp_path / "out", \
        tmp_path / "stderr.log"
    with stderr.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--progress-interval", "1"],
                                stderr=sink)
        deadline = time.monotonic() + 600
        while len(list(out.glob("run-*.parquet"))) < 2:
            assert proc.poll() is None, stderr.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = committed_rows(out)
        running = batchgen("status", str(out), "--json")
        after = committed_rows(out)
        assert proc.wait(timeout=600) == 0, stderr.read_text()[-3000:]
    assert running.returncode == 0, running.stderr
    found = json.loads(running.stdout)
    assert found["state"] == "running" and found["holder"] == f"pid {proc.pid}", found
    assert before <= found["rows_done"] <= after and found["rows_total"] == 30, (before, found, after)
    text = batchgen("status", str(out))
    assert text.returncode == 0 and f"{out}: finished, 30 of 30 rows committed (100.0%)" in text.stdout, text.stdout
    finished = json.loads(batchgen("status", str(out), "--json").stdout)
    assert finished["state"] == "finished" and finished["rows_done"] == 30
    assert json.loads((out / "_SUCCESS").read_text())["rows"] == 30

    lines = stderr.read_text().splitlines()
    progress = [line for line in lines if line.startswith("batchgen: progress ")]
    assert len(progress) >= 2, lines
    assert all(re.fullmatch(r"batchgen: progress [\d,]+/30 rows \([\d.]+%\), [\d.]+ rows/s, [\d.]+ output tok/s "
                            r"over the last [\d.]+ s, ETA \S+(, KV \d+% in use)?, [\d,]+ preemptions, "
                            r"[\d,]+ error rows", line) for line in progress), progress
    assert lines[-1].startswith("  output")  # the summary table closes the log, as on a terminal


@pytest.mark.parametrize("args", [[], ["--json"]])
def test_status_of_a_directory_without_output_is_exit_2(tmp_path, args):
    result = batchgen("status", str(tmp_path), *args)
    assert result.returncode == 2 and "holds no batchgen output" in result.stderr


def scrape(port: int) -> dict[str, float]:
    """The endpoint's samples by name (a histogram's buckets by name and bound); {} while it cannot be reached."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    return {sample.name + (f"{{le={sample.labels['le']}}}" if "le" in sample.labels else ""): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_json_logs_and_metrics_of_one_run(tmp_path):
    """stderr to a file with --log-format json: every line parses, progress lines come at the interval, the last
    holds the summary. Metrics scraped while the run lives grow, and the final (lingering) ones are _SUCCESS's."""
    pytest.importorskip("prometheus_client")
    from s3_server import free_port

    port, out, stderr = free_port(), tmp_path / "out", tmp_path / "stderr.log"
    rows_seen, mid_run = [], {}
    with stderr.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(write_job(tmp_path)), "--log-format",
                                 "json", "--progress-interval", "0.5", "--metrics-port", str(port),
                                 "--metrics-linger", "5"], stderr=sink)
        deadline = time.monotonic() + 600
        while not (out / "_SUCCESS").exists():
            assert proc.poll() is None, stderr.read_text()[-3000:]
            assert time.monotonic() < deadline
            found = scrape(port)
            if "batchgen_rows_total" in found:
                rows_seen.append(found["batchgen_rows_total"])
                mid_run = found if 0 < found["batchgen_rows_total"] < 30 else mid_run
            time.sleep(0.1)
        final = scrape(port)  # lingering: the final values
        assert proc.wait(timeout=120) == 0, stderr.read_text()[-3000:]

    lines = [json.loads(line) for line in stderr.read_text().splitlines()]  # every line parses
    progress = [line for line in lines if "progress" in line]
    assert len(progress) >= 3, lines
    times = [datetime.fromisoformat(line["time"]).timestamp() for line in progress]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(0.4 <= gap <= 2.0 for gap in gaps), gaps
    fields = progress[-1]["progress"]
    assert {"rows_done", "rows_total", "percent", "rows_per_s", "output_tokens_per_s", "eta_s", "kv_in_use",
            "preemptions", "error_rows"} <= set(fields) and fields["rows_total"] == 30
    assert [p["progress"]["rows_done"] for p in progress] == sorted(p["progress"]["rows_done"] for p in progress)
    assert any(p["progress"]["kv_in_use"] is not None for p in progress)
    summary = json.loads((out / "_SUCCESS").read_text())
    assert lines[-1]["message"] == "done" and lines[-1]["summary"] == summary

    assert rows_seen == sorted(rows_seen) and len(set(rows_seen)) >= 3, rows_seen  # they grow
    assert mid_run["batchgen_step_seconds_count"] > 0 and mid_run["batchgen_kv_pool_blocks"] > 0, mid_run
    assert final["batchgen_rows_total"] == summary["rows_this_run"] == 30
    assert final["batchgen_rows_done"] == final["batchgen_rows_input"] == summary["rows"]
    assert final["batchgen_output_tokens_total"] == summary["output_tokens"]
    assert final["batchgen_error_rows_total"] == summary["rows_error"]
    assert final["batchgen_prompt_tokens_total"] == summary["prompt_tokens"]
    assert final["batchgen_cached_tokens_total"] == summary["cached_tokens"]
    assert final["batchgen_preemptions_total"] == summary["preemptions"]
    assert final["batchgen_step_seconds_count"] == final["batchgen_step_seconds_bucket{le=+Inf}"] \
        == summary["engine_stats"]["num_steps"]
    assert final["batchgen_step_seconds_sum"] == pytest.approx(summary["engine_stats"]["step_seconds_sum"])

    refused = batchgen("run", str(tmp_path / "missing.yaml"), "--log-format", "json")
    assert refused.returncode == 2
    error = json.loads(refused.stderr.strip().splitlines()[-1])
    assert error["level"] == "error" and error["exit_code"] == 2 and "missing.yaml" in error["message"]


def test_the_readme_lists_every_metric():
    from batchgen.job.metrics import METRICS, STEP_HISTOGRAM

    readme = (ROOT / "README.md").read_text()
    for name, kind, _, _ in METRICS:
        assert f"`{name}{'_total' if kind == 'counter' else ''}` | {kind} |" in readme, name
    assert f"`{STEP_HISTOGRAM[0]}` | histogram |" in readme
