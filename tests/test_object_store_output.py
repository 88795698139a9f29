"""output.path in object storage (README, "Object storage"; the protocol in docs/architecture.md): on a real
S3-protocol server (moto's, started here on 127.0.0.1, which implements If-None-Match and If-Match), the sample job
from and to s3:// equals the local run, leaving only the final parts and _SUCCESS; `kill -9` at random points and
during the final rewrite, then the same command, gives every row once with the uninterrupted run's texts; two runs
at once: the second exits 75; a lease from another host is taken over once stale; the store unreachable mid-run is exit 1
naming it and the run resumes once it is back; Ray replicas read from and the driver writes to the store with no
directory shared between them; no credential in any object or log line."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

from conftest import cache_copying_builds
from ray_processes import processes_under
from report_pages import render_report
from s3_server import ACCESS_KEY, SECRET_KEY, ThrottlingProxy, free_port, start_s3_server_holding

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = yaml.safe_load((ROOT / "jobs" / "sample.yaml").read_text())
PROMPTS = ROOT / "data" / "samples" / "prompts.parquet"
COMPARED = ["id", "topic", "text", "finish_reason", "error", "prompt_tokens", "output_tokens"]
BUCKET = "outputs"


@pytest.fixture(scope="module")
def s3():
    server = start_s3_server_holding({"inputs/sample/prompts.parquet": PROMPTS}, (BUCKET,))
    yield server
    server.stop()


def write_job(tmp_path: Path, name: str, out_path: str, storage: dict | None = None, **sections) -> Path:
    job = json.loads(json.dumps(SAMPLE))
    job["dtype"] = "float32"
    job["sampling"]["max_tokens"] = 12
    job["input"]["path"] = "s3://inputs/sample/prompts.parquet"
    job["output"] = {**job["output"], "path": out_path, **sections.pop("output", {})}
    job["storage"] = {"lease_ttl_s": 3, **(storage or {})}
    job.update(sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def batchgen(command: str, job: Path, env: dict, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", command, str(job), *args], capture_output=True,
                          text=True, timeout=900, env=env, cwd=cwd)


def objects(s3, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1:]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def names(s3, prefix: str) -> list[str]:
    return sorted(o["Key"][len(prefix) + 1:]
                  for o in s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", []))


def read(s3, prefix: str) -> pl.DataFrame:
    """The finished output as a reader sees it: the parts _SUCCESS names."""
    found = objects(s3, prefix)
    parts = json.loads(found["_SUCCESS"])["parts"]
    assert sorted(parts) == sorted(n for n in found if n.endswith(".parquet")), sorted(found)
    return pl.concat([pl.read_parquet(found[name]) for name in parts]).select(COMPARED)


@pytest.fixture(scope="module")
def local(tmp_path_factory, s3) -> pl.DataFrame:
    """The same job written to a local directory, in input order."""
    tmp = tmp_path_factory.mktemp("local")
    done = batchgen("run", write_job(tmp, "local", str(tmp / "out")), s3.env(), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    return pl.read_parquet(f"{tmp / 'out'}/*.parquet").select(COMPARED)


def test_the_sample_job_to_s3_equals_the_local_run_and_leaks_no_credential(tmp_path, s3, local):
    job = write_job(tmp_path, "remote", f"s3://{BUCKET}/sample")
    planned = batchgen("plan", job, s3.env())
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert f"s3://{BUCKET}/sample: nothing yet" in planned.stdout
    done = batchgen("run", job, s3.env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert read(s3, "sample").equals(local)  # in input order, as the local parts
    found = objects(s3, "sample")
    assert sorted(found) == ["_SUCCESS", "_report.html", "_timeline.json",
                             *sorted(json.loads(found["_SUCCESS"])["parts"])]  # no run part, no lease
    (tmp_path / "from_bucket.html").write_bytes(found["_report.html"])  # the report opens from a copy of the object
    shown, _ = render_report(tmp_path / "from_bucket.html")
    assert shown["health"]["rows"] == ["30"] and [row[2] for row in shown["runs"]] == ["finished"]
    drawn = batchgen("report", f"s3://{BUCKET}/sample", s3.env(), "-o", str(tmp_path / "again.html"))
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert render_report(tmp_path / "again.html")[0]["health"] == shown["health"]
    again = batchgen("run", job, s3.env())
    assert again.returncode == 0 and "is already complete (30 rows)" in again.stderr, again.stderr[-3000:]
    replanned = batchgen("plan", job, s3.env())
    assert f"s3://{BUCKET}/sample: complete (30 rows, _SUCCESS)" in replanned.stdout, replanned.stdout[-2000:]
    for text in [done.stderr, done.stdout, planned.stdout, again.stderr, replanned.stdout, drawn.stdout,
                 drawn.stderr, *(data.decode("latin-1") for data in found.values())]:
        assert ACCESS_KEY not in text and SECRET_KEY not in text

    overwritten = batchgen("run", job, s3.env(), "--overwrite", "--set", "output.order=completion", "--quiet")
    assert overwritten.returncode == 0, overwritten.stderr[-3000:]
    assert read(s3, "sample").sort("id").equals(local.sort("id"))


def test_refusals_name_the_object(tmp_path, s3):
    s3.client().put_object(Bucket=BUCKET, Key="foreign/notes.txt", Body=b"someone's")
    foreign = batchgen("run", write_job(tmp_path, "foreign", f"s3://{BUCKET}/foreign"), s3.env(), "--quiet")
    assert foreign.returncode == 2
    assert f"output.path: s3://{BUCKET}/foreign holds objects batchgen did not write (notes.txt)" in foreign.stderr
    inside = batchgen("run", write_job(tmp_path, "inside", "s3://inputs/sample/out",
                                       input={**SAMPLE["input"], "path": "s3://inputs/sample/"}), s3.env(), "--quiet")
    assert inside.returncode == 2 and "is inside the input" in inside.stderr, inside.stderr


def test_two_runs_at_once_the_second_exits_75_and_a_killed_runs_lease_is_taken_over_once_stale(tmp_path, s3):
    """read() checks that only the final parts are left: the planted duplicate part was deleted, not read. The
    killed run's lease is made another host's (on its own host a re-run takes it over at once:
    test_object_store_isolation.py), whose death no re-run here can see. One row at a time, 12 rows of up to 48 new
    tokens: the first run must outlast a second run's start-up whatever the model's speed (at 2 rows and 12 tokens
    the int8 default model finished first), and each row's arithmetic is that of a run alone, as in the local
    reference."""
    twelve = tmp_path / "twelve.parquet"
    pl.read_parquet(PROMPTS).head(12).write_parquet(twelve)
    s3.client().upload_file(str(twelve), "inputs", "twelve/prompts.parquet")
    sections = {"engine": {**SAMPLE["engine"], "max_num_seqs": 1}, "sampling": {**SAMPLE["sampling"], "max_tokens": 48},
                "input": {**SAMPLE["input"], "path": "s3://inputs/twelve/prompts.parquet"}}
    # a ttl a re-run's start-up (imports, checks) stays well inside on a loaded machine
    job = write_job(tmp_path, "twice", f"s3://{BUCKET}/twice", storage={"lease_ttl_s": 12},
                    output={"rows_per_part": 1, "commit_interval_s": 0.2}, **sections)
    first = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], env=s3.env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "_LEASE" in names(s3, "twice"), first)
    second = batchgen("run", job, s3.env(), "--quiet")
    assert second.returncode == 75, second.stderr[-3000:]
    assert f"output.path: another batchgen run is writing s3://{BUCKET}/twice" in second.stderr
    assert f"pid {first.pid}" in second.stderr
    wait_for(lambda: any(n.startswith("run-") for n in names(s3, "twice")), first)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert "_LEASE" in names(s3, "twice")  # a killed run cannot release it
    lease = {**json.loads(objects(s3, "twice")["_LEASE"]), "host": "another-host"}
    s3.client().put_object(Bucket=BUCKET, Key="twice/_LEASE", Body=json.dumps(lease).encode())
    killed = time.monotonic()
    # what a run that lost its lease could still put: a part repeating committed rows, which must not count twice
    first_part = next(n for n in names(s3, "twice") if n.startswith("run-"))
    s3.client().copy_object(Bucket=BUCKET, Key="twice/run-99999-0123456789ab.parquet",
                            CopySource={"Bucket": BUCKET, "Key": f"twice/{first_part}"})
    refused = batchgen("run", job, s3.env(), "--quiet")
    assert refused.returncode == 75 and "its lease goes stale" in refused.stderr, refused.stderr[-3000:]
    time.sleep(max(0.0, killed + 12.5 - time.monotonic()))  # storage.lease_ttl_s
    taken = batchgen("run", job, s3.env())
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert "took over the stale lease" in taken.stderr
    assert json.loads(objects(s3, "twice")["_SUCCESS"])["resumed"]
    alone = batchgen("run", write_job(tmp_path, "alone", str(tmp_path / "alone"), **sections), s3.env(), "--quiet")
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert read(s3, "twice").equals(pl.read_parquet(f"{tmp_path / 'alone'}/*.parquet").select(COMPARED))


def wait_for(condition, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended first: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.slow
def test_kill_9_at_random_points_and_during_the_final_rewrite_loses_and_repeats_nothing(tmp_path, s3):
    """9 kills of the same job: after random delays, after run parts were committed, once the final parts are being
    written, once the manifest is; each re-run first waits out the killed run's lease. Batch-invariant arithmetic, so
    that a resumed row's text must equal the uninterrupted run's exactly."""
    invariant = {**SAMPLE["engine"], "max_num_seqs": 2, "batch_invariant": True}
    parts = {"rows_per_part": 1, "commit_interval_s": 0.2}
    whole = batchgen("run", write_job(tmp_path, "whole", f"s3://{BUCKET}/whole", engine=invariant, output=parts,
                                      sampling={**SAMPLE["sampling"], "max_tokens": 24}), s3.env(), "--quiet")
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = read(s3, "whole")
    # The final rewrite's writes go through a proxy that holds each for 0.2 s: a window a kill can land in on any
    # machine, where an unhindered rewrite of 30 small parts can finish between two listings of the bucket.
    proxy = ThrottlingProxy(s3.endpoint, throttled=0, slow_puts=("/part-", "_PLAN", "_report", "_SUCCESS"),
                            put_delay_s=0.2)
    job = write_job(tmp_path, "killed", f"s3://{BUCKET}/killed", storage={"endpoint_url": proxy.endpoint},
                    engine=invariant, output=parts, sampling={**SAMPLE["sampling"], "max_tokens": 24})
    rng = random.Random(26)
    points = ["delay"] * 4 + ["parts"] * 2 + ["final parts"] * 2 + ["manifest"]
    kinds_seen = []
    for point in points:
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], env=s3.env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        started = time.monotonic()
        before = len([n for n in names(s3, "killed") if n.startswith("run-")])
        delay, k = rng.uniform(0.5, 6.0), rng.randint(1, 3)
        while proc.poll() is None:
            found = names(s3, "killed")
            rewriting = any(n.startswith("part-") for n in found)  # every point falls in the rewrite at the latest
            if point == "manifest" and "_PLAN.json" in found or point != "manifest" and rewriting \
                    or point == "delay" and time.monotonic() - started > delay \
                    or point == "parts" and len([n for n in found if n.startswith("run-")]) >= before + k:
                break
            time.sleep(0.005)
        if proc.poll() is not None:  # it finished first: this point comes again in the next trial
            assert proc.returncode == 0, proc.stderr.read()[-3000:]
            break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kinds_seen.append((point, sorted({n.split("-")[0].split(".")[0] for n in names(s3, "killed")})))
        assert "_SUCCESS" not in names(s3, "killed")
        time.sleep(3.2)  # the killed run's lease goes stale
    final = batchgen("run", job, s3.env(), "--quiet")
    proxy.stop()
    assert final.returncode == 0, final.stderr[-3000:]
    assert len(kinds_seen) >= 7, kinds_seen
    assert any("part" in kinds for _, kinds in kinds_seen), kinds_seen  # killed with final parts written
    assert any("_PLAN" in kinds for _, kinds in kinds_seen), kinds_seen  # killed with the manifest written
    got = read(s3, "killed")
    assert got["id"].is_unique().all() and got.height == 30
    assert got.equals(expected), kinds_seen


def test_the_store_unreachable_mid_run_is_exit_1_then_the_run_resumes_once_it_is_back(tmp_path, s3, local):
    port = free_port()
    proxy = ThrottlingProxy(s3.endpoint, throttled=0, port=port)
    job = write_job(tmp_path, "cut", f"s3://{BUCKET}/cut", storage={"endpoint_url": proxy.endpoint,
                                                                    "max_retries": 1, "timeout_s": 2},
                    engine={**SAMPLE["engine"], "max_num_seqs": 2}, output={"rows_per_part": 2})
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], env=s3.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(n.startswith("run-") for n in names(s3, "cut")), proc)
    finally:
        proxy.stop()
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"s3://{BUCKET}/cut/" in lines[0] and "object store" in lines[0], stderr
    assert SECRET_KEY not in stderr and ACCESS_KEY not in stderr
    committed = [n for n in names(s3, "cut") if n.startswith("run-")]
    assert committed and "_SUCCESS" not in names(s3, "cut")

    proxy = ThrottlingProxy(s3.endpoint, throttled=0, port=port)  # the store is back
    try:
        time.sleep(3.2)  # the lease the failed run could not delete goes stale
        rerun = batchgen("run", job, s3.env(), "--quiet")
    finally:
        proxy.stop()
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads(objects(s3, "cut")["_SUCCESS"])["resumed"]
    assert read(s3, "cut")["id"].equals(local["id"])


@pytest.mark.slow
def test_ray_replicas_and_driver_share_no_directory(tmp_path, s3, local):
    """A Ray cluster started apart (its own working, temp and cache directories), the driver in others: the
    replicas read their windows from the store, the driver writes the parts there; one replica is killed mid-run
    and its window run again, every row once."""
    pytest.importorskip("ray")
    cluster = Path(tempfile.mkdtemp(prefix="bg-", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    driver = tmp_path / "driver"
    for folder in (cluster / "tmp", driver / "tmp"):
        folder.mkdir(parents=True)
    # The cluster and the driver each hold their own copies of the default model's conversion and the C++ kernels:
    # replicas converting and compiling at once, two minutes of the suite, are tests/test_loader.py's case
    # (test_concurrent_conversion_uses_the_winner) and tests/test_cpu_attention.py's.
    cache_copying_builds(cluster / "cache")
    cache_copying_builds(driver / "cache")
    port = free_port()
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}  # as a real cluster's driver is given
    cluster_env = {**s3.env(), **token, "TMPDIR": str(cluster / "tmp"), "BATCHGEN_CACHE_DIR": str(cluster / "cache")}
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    try:
        started = subprocess.run([*ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                                  "--num-cpus=2",
                                  "--include-dashboard=false", f"--temp-dir={cluster / 'tmp'}",
                                  "--disable-usage-stats"], cwd=cluster, env=cluster_env, capture_output=True,
                                 text=True, timeout=300)
        assert started.returncode == 0, started.stderr[-3000:]
        job = write_job(driver, "ray", f"s3://{BUCKET}/ray", executor={"kind": "ray", "replicas": 2,
                                                                       "cpus_per_replica": 1, "batch_size": 5},
                        output={"rows_per_part": 2})
        env = {**s3.env(), **token, "RAY_ADDRESS": f"127.0.0.1:{port}", "TMPDIR": str(driver / "tmp"),
               "BATCHGEN_CACHE_DIR": str(driver / "cache")}
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], env=env, cwd=driver,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: any(n.startswith("run-") for n in names(s3, "ray")), proc)
        replicas = [p for p in processes_under(lambda cmdline: str(cluster) in cmdline)
                    if "EngineReplica" in " ".join(p.cmdline())]
        assert replicas, "no replica process found"
        replicas[0].send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
    finally:
        subprocess.run([*ray, "stop", "--force"], env=cluster_env, capture_output=True, timeout=120)
        shutil.rmtree(cluster, ignore_errors=True)
    assert read(s3, "ray").equals(local)
    assert not list(driver.rglob("*.parquet"))


def test_an_aws_profile_gives_the_keys_region_and_endpoint_and_its_secret_is_never_shown(tmp_path, s3):
    """No credential or endpoint in the environment: the profile AWS_PROFILE names in the SDKs' shared files gives
    them (a proxy in front of the server records which access key signed each request)."""
    proxy = ThrottlingProxy(s3.endpoint, throttled=0)
    (tmp_path / "credentials").write_text("[other]\naws_access_key_id = AKIAOTHERPROFILE0000\n"
                                          "aws_secret_access_key = other/secret\n\n[pipeline]\n"
                                          "aws_access_key_id = AKIAPROFILEPLANTED01\n"
                                          "aws_secret_access_key = profile+Planted/Secret/7c2e\n")
    (tmp_path / "config").write_text(f"[profile pipeline]\nregion = us-east-1\nendpoint_url = {proxy.endpoint}\n")
    env = {key: value for key, value in s3.env().items() if not key.startswith("AWS_")}
    env.update(AWS_PROFILE="pipeline", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"),
               AWS_CONFIG_FILE=str(tmp_path / "config"))
    job = write_job(tmp_path, "profile", f"s3://{BUCKET}/profile", output={"rows_per_part": 10})
    try:
        done = batchgen("run", job, env)
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    assert proxy.access_keys == {"AKIAPROFILEPLANTED01"}
    texts = [done.stderr, done.stdout, *(data.decode("latin-1") for data in objects(s3, "profile").values())]
    assert not any("profile+Planted/Secret/7c2e" in text for text in texts)


def test_a_run_whose_lease_was_taken_over_stops_writing(tmp_path, s3):
    """As if the run had stalled past its ttl and another took the output over: its next refresh finds another
    ETag, and it stops (exit 1) before writing anything more."""
    job = write_job(tmp_path, "lost", f"s3://{BUCKET}/lost", engine={**SAMPLE["engine"], "max_num_seqs": 1},
                    output={"rows_per_part": 1, "commit_interval_s": 0.1})
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], env=s3.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any(n.startswith("run-") for n in names(s3, "lost")), proc)
    s3.client().put_object(Bucket=BUCKET, Key="lost/_LEASE", Body=json.dumps({"run_id": "other", "ttl_s": 3}))
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr[-3000:]
    assert "this run lost its lease on the output (another run took it over)" in stderr, stderr[-3000:]
    assert json.loads(objects(s3, "lost")["_LEASE"])["run_id"] == "other"  # left to its new holder
    assert "_SUCCESS" not in names(s3, "lost")
