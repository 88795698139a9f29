"""input.path in object storage (README, "Object storage"): the sample job read from s3:// on a real S3-protocol
server (moto's, started here on 127.0.0.1) gives the local run's output; a prefix and a glob over hive-style
partitions find the right objects; a rewritten object is refused on resume; an unreachable store is exit 1 with one
line naming it; `batchgen plan` reads the object; and the credentials in the environment appear in no output file
and no log line."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml

from s3_server import ACCESS_KEY, SECRET_KEY, start_s3_server

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


def test_the_sample_job_from_s3_equals_the_local_run_and_leaks_no_credential(tmp_path, s3):
    local = batchgen("run", write_job(tmp_path, "local", str(PROMPTS)), s3.env(), "--quiet")
    assert local.returncode == 0, local.stderr[-3000:]
    remote = batchgen("run", write_job(tmp_path, "remote", "s3://inputs/sample/prompts.parquet"), s3.env())
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert read(tmp_path / "remote").equals(read(tmp_path / "local"))
    success = json.loads((tmp_path / "remote" / "_SUCCESS").read_text())
    assert "s3://inputs/sample/prompts.parquet" in json.dumps(success)
    planned = batchgen("plan", write_job(tmp_path, "planned", "s3://inputs/sample/prompts.parquet"), s3.env())
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "s3://inputs/sample/prompts.parquet: 1 file, 30 rows" in planned.stdout
    for text in [remote.stderr, remote.stdout, planned.stdout, planned.stderr,
                 *(path.read_bytes().decode("latin-1") for path in (tmp_path / "remote").rglob("*") if path.is_file())]:
        assert ACCESS_KEY not in text and SECRET_KEY not in text


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


def test_a_missing_object_is_a_job_error(tmp_path, s3):
    result = batchgen("run", write_job(tmp_path, "out", "s3://inputs/nothing-here/"), s3.env(), "--quiet")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "input.path: no Parquet objects found at s3://inputs/nothing-here/" in result.stderr


def _closed_port() -> int:
    from s3_server import free_port

    return free_port()
