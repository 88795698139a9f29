"""What keeps one job's object-store output apart from every other run's (README, "Object storage"; the protocol in
docs/architecture.md), through the CLI against moto's S3 server on 127.0.0.1: an output inside another job's output,
or holding one, is refused (exit 2) as on disk; a run refused by a live lease or the local lock exits 75 saying how
long to wait, while a killed run's lease is taken over at once on its own host; a run the store stalled deletes its
lease; a missing bucket is exit 2 naming the key; `batchgen status` on parts of one second, on a live lease and on
objects batchgen did not write; the lease-loss line and JSON error lines."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import polars as pl
import psutil
import pytest
import yaml

from s3_server import ThrottlingProxy, start_s3_server_holding

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = yaml.safe_load((ROOT / "jobs" / "sample.yaml").read_text())
BUCKET = "outputs"
ROWS = 6
RUN_PARTS_SLOWED = ("/run-", "/part-", "_SUCCESS")  # a run's commits, held long enough for a test to act between


@pytest.fixture(scope="module")
def small_input(tmp_path_factory) -> Path:
    """A few sample prompts, without the per-row max_tokens column: each row generates max_tokens (2) at most."""
    path = tmp_path_factory.mktemp("input") / "prompts.parquet"
    pl.read_parquet(ROOT / "data" / "samples" / "prompts.parquet").head(ROWS).drop("max_tokens").write_parquet(path)
    return path


@pytest.fixture(scope="module")
def s3(small_input):
    server = start_s3_server_holding({"inputs/small/prompts.parquet": small_input}, (BUCKET,))
    yield server
    server.stop()


def write_job(tmp_path: Path, name: str, out_path: str, storage: dict | None = None, **sections) -> Path:
    job = json.loads(json.dumps(SAMPLE))
    job.update(dtype="float32", engine={**SAMPLE["engine"], "max_num_seqs": 1})
    job["sampling"]["max_tokens"] = 2
    job["input"]["path"] = "s3://inputs/small/prompts.parquet"
    job["output"] = {**job["output"], "path": out_path, "rows_per_part": 1, "commit_interval_s": 0.1,
                     **sections.pop("output", {})}
    job["storage"] = {"lease_ttl_s": 60, **(storage or {})}
    job.update(sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def batchgen(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", *map(str, args)], capture_output=True, text=True,
                          timeout=900, env=env)


def start(env: dict, job: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def names(s3, prefix: str) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1:] for o in listed)


def wait_for_run_part(s3, prefix: str, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 600
    while not any(n.startswith("run-") for n in names(s3, prefix)):
        assert proc.poll() is None, f"the run ended first: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return next(n for n in names(s3, prefix) if n.startswith("run-"))


def error_line(result: subprocess.CompletedProcess, code: int) -> str:
    """The run's one stderr line, a `batchgen: error:` line, after it exited with `code`."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    assert lines[0].startswith("batchgen: error: "), lines
    return lines[0]


def put_lease(s3, prefix: str, **holder) -> None:
    """A fresh `_LEASE` as a running batchgen writes it."""
    body = {"run_id": "0123456789ab", "host": "another-host", "pid": 4242, "ttl_s": 60, **holder}
    s3.client().put_object(Bucket=BUCKET, Key=f"{prefix}/_LEASE", Body=json.dumps(body).encode())


def test_an_output_inside_another_jobs_output_or_holding_one_is_refused(tmp_path, s3, small_input):
    put_lease(s3, "nest")  # a run writing s3://outputs/nest
    inside = batchgen(s3.env(), "run", write_job(tmp_path, "inside", f"s3://{BUCKET}/nest/deeper/sub"), "--quiet")
    assert error_line(inside, 2) == (
        f"batchgen: error: output.path: s3://{BUCKET}/nest/deeper/sub is inside s3://{BUCKET}/nest, another "
        f"batchgen job's output (its readers would read these rows too); choose an output.path outside it")
    assert names(s3, "nest") == ["_LEASE"]

    s3.client().put_object(Bucket=BUCKET, Key="outer/sub/_SUCCESS", Body=json.dumps({"fingerprint": {}}).encode())
    holding = batchgen(s3.env(), "run", write_job(tmp_path, "outer", f"s3://{BUCKET}/outer"), "--quiet")
    assert error_line(holding, 2) == (
        f"batchgen: error: output.path: s3://{BUCKET}/outer holds s3://{BUCKET}/outer/sub, another batchgen job's "
        f"output (readers of this output would read its rows too); choose another output.path")

    s3.client().upload_file(str(small_input), BUCKET, "parts/a/b/run-00000-0123456789ab.parquet")
    planned = batchgen(s3.env(), "plan", write_job(tmp_path, "parts", f"s3://{BUCKET}/parts"))
    assert planned.returncode == 2, planned.stderr[-3000:]
    assert f"output.path: s3://{BUCKET}/parts holds s3://{BUCKET}/parts/a/b, another" in planned.stderr

    s3.client().put_object(Bucket=BUCKET, Key="spark/_SUCCESS", Body=b"")  # another tool's marker: no output of ours
    beside = batchgen(s3.env(), "plan", write_job(tmp_path, "beside", f"s3://{BUCKET}/spark/out"))
    assert beside.returncode == 0, beside.stderr[-3000:]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, s3) -> Path:
    """A run killed (-9) after its first run part, its lease (ttl 60 s) left behind; two copies of that part put
    within one second under `second/`, as two parts committed in the same second of Last-Modified."""
    job = write_job(tmp_path_factory.mktemp("killed"), "killed", f"s3://{BUCKET}/killed")
    proxy = ThrottlingProxy(s3.endpoint, throttled=0, slow_puts=RUN_PARTS_SLOWED, put_delay_s=0.3)
    proc = start(s3.env(AWS_ENDPOINT_URL=proxy.endpoint), job)
    try:
        part = wait_for_run_part(s3, "killed", proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proxy.stop()
    client = s3.client()
    for _ in range(10):
        for name in ("run-00000-aaaaaaaaaaaa.parquet", "run-00001-bbbbbbbbbbbb.parquet"):
            client.copy_object(Bucket=BUCKET, Key=f"second/{name}", CopySource={"Bucket": BUCKET,
                                                                               "Key": f"killed/{part}"})
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix="second/")["Contents"]
        if len({o["LastModified"] for o in listed}) == 1:
            break
    assert "_LEASE" in names(s3, "killed")
    return job


def test_status_reads_parts_of_one_second_names_a_holder_and_refuses_what_batchgen_did_not_write(s3, killed,
                                                                                               small_input):
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix="second/")["Contents"]
    assert len({o["LastModified"] for o in listed}) == 1, listed
    same_second = batchgen(s3.env(), "status", f"s3://{BUCKET}/second", "--json")
    assert same_second.returncode == 0, same_second.stderr[-3000:]
    assert json.loads(same_second.stdout)["state"] == "stopped"

    put_lease(s3, "held")
    held = batchgen(s3.env(), "status", f"s3://{BUCKET}/held")
    assert held.returncode == 0, held.stderr[-3000:]
    assert re.search(r"; written by run 0123456789ab on host another-host \(pid 4242\), lease refreshed \d+ s ago$",
                     held.stdout.strip()), held.stdout

    s3.client().upload_file(str(small_input), BUCKET, "foreign/run-00000-0123456789ab.parquet")
    foreign = batchgen(s3.env(), "status", f"s3://{BUCKET}/foreign")
    assert error_line(foreign, 2) == (f"batchgen: error: output: s3://{BUCKET}/foreign holds files batchgen did not "
                                      f"write (run-00000-0123456789ab.parquet): it is not a batchgen output")


def test_a_killed_runs_lease_is_taken_over_at_once_on_its_host(s3, killed):
    rerun = batchgen(s3.env(), "run", killed)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "took over the lease of a run that is gone" in rerun.stderr
    found = names(s3, "killed")
    success = json.loads(s3.client().get_object(Bucket=BUCKET, Key="killed/_SUCCESS")["Body"].read())
    assert success["resumed"] and sorted(success["parts"]) == [n for n in found if n.endswith(".parquet")]
    rows = pl.concat([pl.read_parquet(io.BytesIO(s3.client().get_object(Bucket=BUCKET, Key=f"killed/{name}")
                                                 ["Body"].read())) for name in success["parts"]])
    assert rows.height == ROWS and rows["id"].is_unique().all()


def test_a_live_lease_is_exit_75_saying_how_long_to_wait(tmp_path, s3):
    job = write_job(tmp_path, "busy", f"s3://{BUCKET}/busy")
    put_lease(s3, "busy", host=socket.gethostname(), pid=os.getpid(), pid_started=psutil.Process().create_time(),
              pid_ns=os.readlink("/proc/self/ns/pid"))  # this very process, alive
    here = error_line(batchgen(s3.env(), "run", job, "--quiet"), 75)
    assert here.startswith(f"batchgen: error: output.path: another batchgen run is writing s3://{BUCKET}/busy (run "
                           f"0123456789ab on host {socket.gethostname()} (pid {os.getpid()}), lease refreshed "), here
    assert here.endswith(f"; pid {os.getpid()} is alive on this host: retry once it has finished (a re-run takes "
                         f"over as soon as it is gone)"), here
    put_lease(s3, "busy")
    elsewhere = error_line(batchgen(s3.env(), "run", job, "--quiet"), 75)
    assert "(run 0123456789ab on host another-host (pid 4242), lease refreshed " in elsewhere
    assert re.search(r"; retry once it has finished; if it was killed, its lease goes stale \d+ s from now and a "
                     r"re-run takes over then$", elsewhere), elsewhere
    assert names(s3, "busy") == ["_LEASE"]


def test_a_second_run_on_a_local_output_exits_75(tmp_path, small_input):
    from batchgen.job.output.output_dir import OutputDir, lock_output

    job = write_job(tmp_path, "local", str(tmp_path / "out"), input={**SAMPLE["input"], "path": str(small_input)})
    held = lock_output(OutputDir(tmp_path / "out"))  # as a running batchgen holds it
    try:
        second = batchgen(dict(os.environ), "run", job, "--quiet")
    finally:
        os.close(held)
    assert error_line(second, 75) == (f"batchgen: error: output.path: another batchgen run is writing "
                                      f"{tmp_path / 'out'} (pid {os.getpid()}); retry once it has finished")


def test_a_missing_bucket_is_exit_2_naming_the_key_and_the_bucket(tmp_path, s3):
    cases = {"input.path": ("s3://no-such-input/prompts.parquet", {"input": {**SAMPLE["input"],
                                                                            "path": "s3://no-such-input/prompts.parquet"}}),
             "output.path": ("s3://no-such-output/out", {}),
             "model": ("s3://no-such-model/smol", {"model": "s3://no-such-model/smol"})}
    for key, (url, sections) in cases.items():
        out = url if key == "output.path" else f"s3://{BUCKET}/never"
        result = batchgen(s3.env(), "run", write_job(tmp_path, key, out, **sections), "--quiet")
        bucket = url.split("/")[2]
        assert error_line(result, 2) == f"batchgen: error: {key}: {url}: the bucket {bucket} does not exist"
    status = batchgen(s3.env(), "status", "s3://no-such-output/out")
    assert error_line(status, 2) == "batchgen: error: output: s3://no-such-output/out: the bucket no-such-output " \
                                    "does not exist"


@pytest.mark.slow
def test_a_run_the_store_stalled_deletes_its_lease_and_a_rerun_starts_at_once(tmp_path, s3):
    """The store stops answering for longer than the lease's ttl, then comes back: the run fails (exit 1), having
    lost its lease, which no run took over meanwhile: it deletes it, and the next run takes the output at once."""
    proxy = ThrottlingProxy(s3.endpoint, throttled=0, slow_puts=RUN_PARTS_SLOWED, put_delay_s=0.3)
    job = write_job(tmp_path, "stalled", f"s3://{BUCKET}/stalled", storage={"lease_ttl_s": 2, "max_retries": 0,
                                                                            "timeout_s": 30})
    proc = start(s3.env(AWS_ENDPOINT_URL=proxy.endpoint), job)
    try:
        wait_for_run_part(s3, "stalled", proc)
        proxy.stall_until = time.monotonic() + 4  # twice the ttl
        _, stderr = proc.communicate(timeout=600)
    finally:
        proxy.stop()
    assert proc.returncode == 1, stderr[-3000:]
    found = names(s3, "stalled")
    assert "_LEASE" not in found and any(n.startswith("run-") for n in found), found
    rerun = batchgen(s3.env(), "run", job, "--quiet")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads(s3.client().get_object(Bucket=BUCKET, Key="stalled/_SUCCESS")["Body"].read())["rows"] == ROWS


def test_a_lost_lease_says_once_that_rows_are_kept_and_a_json_error_line_has_its_time(tmp_path, s3):
    proxy = ThrottlingProxy(s3.endpoint, throttled=0, slow_puts=RUN_PARTS_SLOWED, put_delay_s=0.3)
    job = write_job(tmp_path, "lost", f"s3://{BUCKET}/lost", storage={"lease_ttl_s": 3})
    proc = start(s3.env(AWS_ENDPOINT_URL=proxy.endpoint), job, "--log-format", "json")
    try:
        wait_for_run_part(s3, "lost", proc)
        put_lease(s3, "lost")  # taken over, as if this run had stalled past its ttl
        _, stderr = proc.communicate(timeout=600)
    finally:
        proxy.stop()
    assert proc.returncode == 1, stderr[-3000:]
    last = json.loads(stderr.strip().splitlines()[-1])
    assert last["level"] == "error" and last["exit_code"] == 1
    assert datetime.fromisoformat(last["time"]).tzinfo is not None
    assert "this run lost its lease on the output (another run took it over)" in last["message"]
    assert last["message"].count("committed rows are kept") == 1, last["message"]
