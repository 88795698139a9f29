"""input.path in object storage (README, "Object storage"): the sample job read from s3:// on a real S3-protocol
server (moto's, started here on 127.0.0.1) gives the local run's output; a prefix and a glob over hive-style
partitions find the right objects; a rewritten object is refused on resume; an unreachable store is exit 1 with one
line naming it; `batchgen plan` reads the object; and the credentials in the environment appear in no output file
and no log line."""
from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import cache_sharing_builds
from s3_server import ACCESS_KEY, SECRET_KEY, ThrottlingProxy, start_s3_server

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = yaml.safe_load((ROOT / "jobs" / "sample.yaml").read_text())
PROMPTS = ROOT / "data" / "samples" / "prompts.parquet"
COMPARED = ["id", "topic", "text", "finish_reason", "error", "prompt_tokens", "output_tokens"]


@pytest.fixture(scope="module")
def s3():
    server = start_s3_server()
    client = server.client()
    client.create_bucket(Bucket="inputs")
    client.upload_file(str(PROMPTS), "inputs", "sample/prompts.parquet")
    table = pq.read_table(PROMPTS)
    for i, day in enumerate(["2026-01-01", "2026-01-02"]):  # hive-style partitions, 15 rows each
        client.put_object(Bucket="inputs", Key=f"hive/date={day}/part-0.parquet",
                          Body=parquet_bytes(table.slice(15 * i, 15)))
    client.put_object(Bucket="inputs", Key="hive/_staging/part-0.parquet", Body=parquet_bytes(table))  # skipped
    client.put_object(Bucket="inputs", Key="hive/date=2026-01-01/.part-1.parquet.crc", Body=b"not parquet")
    yield server
    server.stop()


def parquet_bytes(table, compression: str = "snappy") -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression=compression)
    return buffer.getvalue()


def write_job(tmp_path: Path, name: str, input_path: str, **sections) -> Path:
    job = json.loads(json.dumps(SAMPLE))
    job["dtype"] = "float32"  # fp32: greedy texts compared across runs
    job["sampling"]["max_tokens"] = 12
    job["input"]["path"] = input_path
    job["output"]["path"] = str(tmp_path / name)
    job.update(sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def batchgen(command: str, job: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", command, str(job), *args], capture_output=True,
                          text=True, timeout=900, env=env)


def read(out: Path) -> pl.DataFrame:
    return pl.read_parquet(f"{out}/*.parquet").select(COMPARED).sort("id")


@pytest.fixture(scope="module")
def local(tmp_path_factory, s3) -> pl.DataFrame:
    """The sample job's output read from the local file."""
    tmp = tmp_path_factory.mktemp("local")
    done = batchgen("run", write_job(tmp, "local", str(PROMPTS)), s3.env(), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    return read(tmp / "local")


def test_the_sample_job_from_s3_equals_the_local_run_and_leaks_no_credential(tmp_path, s3, local):
    remote = batchgen("run", write_job(tmp_path, "remote", "s3://inputs/sample/prompts.parquet"), s3.env())
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert read(tmp_path / "remote").equals(local)
    success = json.loads((tmp_path / "remote" / "_SUCCESS").read_text())
    assert "s3://inputs/sample/prompts.parquet" in json.dumps(success)
    planned = batchgen("plan", write_job(tmp_path, "planned", "s3://inputs/sample/prompts.parquet"), s3.env())
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "s3://inputs/sample/prompts.parquet: 1 file, 30 rows" in planned.stdout
    for text in [remote.stderr, remote.stdout, planned.stdout, planned.stderr,
                 *(path.read_bytes().decode("latin-1") for path in (tmp_path / "remote").rglob("*") if path.is_file())]:
        assert ACCESS_KEY not in text and SECRET_KEY not in text


def test_json_lines_and_gzipped_csv_objects_give_the_parquet_objects_output(tmp_path, s3, local, monkeypatch):
    """Text inputs from the store: listed under a prefix by their names, read (through the gzip) into the cache's
    Parquet copy, and identified by their ETag in the fingerprint."""
    frame = pl.read_parquet(PROMPTS)
    client = s3.client()
    client.put_object(Bucket="inputs", Key="text/jsonl/prompts.jsonl", Body=frame.write_ndjson().encode())
    client.put_object(Bucket="inputs", Key="text/csv/prompts.csv.gz", Body=gzip.compress(frame.write_csv().encode()))
    env = {**s3.env(), "BATCHGEN_CACHE_DIR": str(cache_sharing_builds(tmp_path / "cache"))}
    for kind in ("jsonl", "csv"):
        done = batchgen("run", write_job(tmp_path, kind, f"s3://inputs/text/{kind}/"), env, "--quiet")
        assert done.returncode == 0, done.stderr[-3000:]
        assert read(tmp_path / kind).equals(local)
        [file] = json.loads((tmp_path / kind / "_SUCCESS").read_text())["fingerprint"]["files"]
        assert file["format"] == kind and file["etag"] and file["path"].startswith(f"s3://inputs/text/{kind}/")


@pytest.mark.slow
def test_ray_replicas_read_their_windows_from_the_store(tmp_path, s3, local):
    """Each replica opens the objects of its window itself (the driver sends it the listing, not the rows)."""
    pytest.importorskip("ray")
    job = write_job(tmp_path, "ray", "s3://inputs/hive/", executor={"kind": "ray", "replicas": 2,
                                                                     "cpus_per_replica": 1, "batch_size": 8})
    done = batchgen("run", job, s3.env(), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert read(tmp_path / "ray").equals(local)


@pytest.mark.parametrize("path", ["s3://inputs/hive", "s3://inputs/hive/", "s3://inputs/hive/date=2026-*",
                                  "s3://inputs/hive/date=2026-01-0[12]/*.parquet"])
def test_a_prefix_or_a_glob_finds_the_partitions_and_skips_hidden_names(tmp_path, s3, path):
    from batchgen.job.input.files import find_input_files
    from batchgen.object_store import StorageConfig

    saved = dict(os.environ)
    os.environ.update(s3.env())
    try:
        files = find_input_files(path, StorageConfig())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert [str(f) for f in files] == ["s3://inputs/hive/date=2026-01-01/part-0.parquet",
                                       "s3://inputs/hive/date=2026-01-02/part-0.parquet"]
    assert all(f.size > 0 and f.etag for f in files)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_hive_partition_keys_are_columns_to_keep(tmp_path, s3, local, where):
    """date=... folders (prefix parts) above the files give each row a `date` column, a string, as Ray Data and
    pyarrow's hive partitioning do; the rows are the same as from the one file."""
    table = pq.read_table(PROMPTS)
    if where == "local":
        for i, day in enumerate(["2026-01-01", "2026-01-02"]):
            (tmp_path / "hive" / f"date={day}").mkdir(parents=True)
            pq.write_table(table.slice(15 * i, 15), tmp_path / "hive" / f"date={day}" / "part-0.parquet")
    path = str(tmp_path / "hive") if where == "local" else "s3://inputs/hive/"
    job = write_job(tmp_path, "out", path,
                    output={**SAMPLE["output"], "path": str(tmp_path / "out"), "keep_columns": ["topic", "date"]})
    done = batchgen("run", job, s3.env(), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    out = pl.read_parquet(f"{tmp_path / 'out'}/*.parquet")
    assert out.schema["date"] == pl.String
    expected = {ident: "2026-01-01" if i < 15 else "2026-01-02" for i, ident in enumerate(table["id"].to_pylist())}
    assert dict(zip(out["id"].to_list(), out["date"].to_list())) == expected
    assert out.select(COMPARED).sort("id").equals(local)


def test_a_rewritten_input_object_is_refused_on_resume(tmp_path, s3):
    client = s3.client()
    client.upload_file(str(PROMPTS), "inputs", "rewritten/prompts.parquet")
    job = write_job(tmp_path, "out", "s3://inputs/rewritten/prompts.parquet")
    first = batchgen("run", job, s3.env(), "--quiet")
    assert first.returncode == 0, first.stderr[-3000:]
    client.put_object(Bucket="inputs", Key="rewritten/prompts.parquet",  # the same rows, other bytes: a new ETag
                      Body=parquet_bytes(pq.read_table(PROMPTS), compression="gzip"))
    again = batchgen("run", job, s3.env(), "--quiet")
    assert again.returncode == 2, again.stderr[-3000:]
    assert "s3://inputs/rewritten/prompts.parquet" in again.stderr and "etag" in again.stderr.lower()


def test_an_unreachable_store_is_one_error_line_naming_it(tmp_path, s3):
    closed = f"http://127.0.0.1:{_closed_port()}"
    job = write_job(tmp_path, "out", "s3://inputs/sample/prompts.parquet",
                    storage={"endpoint_url": closed, "max_retries": 1, "timeout_s": 2})
    result = batchgen("run", job, s3.env(), "--quiet")
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchgen: error:"), result.stderr
    assert "s3://inputs/sample/prompts.parquet" in lines[0] and "object store" in lines[0]
    assert SECRET_KEY not in result.stderr and ACCESS_KEY not in result.stderr


@pytest.mark.parametrize("throttled", [3, None], ids=["throttled-then-served", "always-throttled"])
def test_503_slowdown_is_retried_with_backoff_then_one_error_line(tmp_path, s3, local, throttled):
    """S3 answers 503 SlowDown under load: a few are retried (the job finishes, the same rows), an endless run of
    them ends in exit 1 after storage.max_retries, one line naming the object."""
    proxy = ThrottlingProxy(s3.endpoint, throttled)
    try:
        job = write_job(tmp_path, "out", "s3://inputs/sample/prompts.parquet",
                        storage={"endpoint_url": proxy.endpoint, "max_retries": 4, "timeout_s": 5})
        result = batchgen("run", job, s3.env(), "--quiet")
    finally:
        proxy.stop()
    if throttled is not None:
        assert result.returncode == 0, result.stderr[-3000:]
        assert read(tmp_path / "out").equals(local)
        return
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "s3://inputs/sample/prompts.parquet" in lines[0] and "object store" in lines[0]
    assert proxy.requests == 5  # the first request and its 4 retries


def test_a_missing_object_is_a_job_error(tmp_path, s3):
    result = batchgen("run", write_job(tmp_path, "out", "s3://inputs/nothing-here/"), s3.env(), "--quiet")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "input.path: no input objects found at s3://inputs/nothing-here/ (names ending in .parquet" in result.stderr


def test_a_store_stopped_mid_run_is_exit_1_and_a_rerun_after_its_restart_resumes(tmp_path):
    """The run notices at its next request (at the latest the end-of-run check that no input object changed) and
    fails with one line naming the object; committed parts stay; the store back (the same object: the same ETag),
    the same command finishes the job with every row once."""
    server = start_s3_server()
    port = server.endpoint.rsplit(":", 1)[1]
    try:
        server.client().create_bucket(Bucket="midrun")
        server.client().put_object(Bucket="midrun", Key="prompts.parquet", Body=PROMPTS.read_bytes())
        job = write_job(tmp_path, "out", "s3://midrun/prompts.parquet", storage={"max_retries": 1, "timeout_s": 2},
                        engine={**SAMPLE["engine"], "max_num_seqs": 2})
        edited = yaml.safe_load(job.read_text())
        edited["output"].update(rows_per_part=2, commit_interval_s=0.5)
        job.write_text(yaml.safe_dump(edited, sort_keys=False))
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], env=server.env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while not list((tmp_path / "out").glob("run-*.parquet")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        server.stop()
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 1, stderr[-3000:]
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "s3://midrun/prompts.parquet" in lines[0] and "object store" in lines[0], stderr
        assert list((tmp_path / "out").glob("run-*.parquet")) and not (tmp_path / "out" / "_SUCCESS").exists()

        server = start_s3_server(int(port))  # moto keeps nothing: the same bytes again, so the same ETag
        server.client().create_bucket(Bucket="midrun")
        server.client().put_object(Bucket="midrun", Key="prompts.parquet", Body=PROMPTS.read_bytes())
        rerun = batchgen("run", job, server.env(), "--quiet")
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        summary = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
        assert summary["resumed"]
        ids = pl.read_parquet(f"{tmp_path / 'out'}/*.parquet")["id"]
        assert ids.len() == 30 and ids.is_unique().all()
    finally:
        server.stop()


def _closed_port() -> int:
    from s3_server import free_port

    return free_port()
