"""Which object-store library for s3:// inputs and outputs (issue 26): pyarrow's own S3FileSystem, fsspec + s3fs, or
obstore, measured against a local S3-protocol server (moto's, started here on 127.0.0.1) on the same files:

- read: a ROWS-row input of prompts, streamed a row group at a time (range reads, never the whole object), rows/s
  and the reading process's peak RSS;
- write: PARTS Parquet parts of the output's shape, parts/s;
- conditional writes: a create-only put (If-None-Match: *) of an object that exists must fail, and an update
  conditioned on a stale ETag (If-Match) must fail — what the output's lease and immutable run parts need.

Each library runs in a fresh process (its peak RSS is its own). The server is moto's Python server, itself a
bottleneck: the rates compare the libraries on one server, not against a real store.

    python scripts/object_store_bench.py [--rows 1000000] [--parts 16]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUCKET = "bench"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, endpoint
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("moto's server did not start")


def make_input(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)  # every prompt its own: 20-60 words of a 5,000-word vocabulary, as little compressible
    vocabulary = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9))) for _ in range(5000)]
    prompts = [" ".join(rng.choices(vocabulary, k=rng.randint(20, 60))) for _ in range(rows)]
    table = pa.table({"id": pa.array(range(rows), pa.int64()), "prompt": pa.array(prompts)})
    pq.write_table(table, path, row_group_size=65536)


# --- each library, in its own process -------------------------------------------------------------------------------

def read_with(library: str, endpoint: str, key: str) -> int:
    import pyarrow.parquet as pq

    if library == "pyarrow":
        from pyarrow import fs
        s3 = fs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1")
        handle = s3.open_input_file(f"{BUCKET}/{key}")
    elif library == "s3fs":
        import s3fs
        handle = s3fs.S3FileSystem(endpoint_url=endpoint).open(f"{BUCKET}/{key}", "rb")
    else:
        import obstore
        from obstore.store import S3Store
        store = S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True}, region="us-east-1")
        from batchgen.object_store import RangeReader  # what batchgen reads objects through
        handle = RangeReader(obstore.open_reader(store, key, buffer_size=1 << 20), key)  # as batchgen reads
    rows = 0
    for batch in pq.ParquetFile(handle).iter_batches(batch_size=65536, columns=["id", "prompt"]):
        rows += batch.num_rows
    return rows


def write_with(library: str, endpoint: str, parts: int, payload: bytes) -> None:
    if library == "pyarrow":
        from pyarrow import fs
        s3 = fs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1")
        for i in range(parts):
            with s3.open_output_stream(f"{BUCKET}/out-{library}/run-{i:05d}.parquet") as out:
                out.write(payload)
    elif library == "s3fs":
        import s3fs
        s3 = s3fs.S3FileSystem(endpoint_url=endpoint)
        for i in range(parts):
            s3.pipe_file(f"{BUCKET}/out-{library}/run-{i:05d}.parquet", payload)
    else:
        import obstore
        from obstore.store import S3Store
        store = S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True}, region="us-east-1")
        for i in range(parts):
            obstore.put(store, f"out-{library}/run-{i:05d}.parquet", payload, mode="create")


def conditional_with(library: str, endpoint: str) -> dict:
    """Whether a create-only put of an existing object fails, and an update on a stale ETag fails."""
    key = f"lease-{library}"
    if library == "obstore":
        import obstore
        from obstore.store import S3Store
        store = S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True}, region="us-east-1")
        first = obstore.put(store, key, b"1", mode="create")
        result = {}
        try:
            obstore.put(store, key, b"2", mode="create")
            result["create_only"] = False
        except Exception as exc:  # AlreadyExistsError, PreconditionError
            result["create_only"] = type(exc).__name__
        obstore.put(store, key, b"3", mode={"e_tag": first["e_tag"]})  # current ETag: succeeds
        try:
            obstore.put(store, key, b"4", mode={"e_tag": first["e_tag"]})  # now stale
            result["if_match"] = False
        except Exception as exc:
            result["if_match"] = type(exc).__name__
        return result
    if library == "s3fs":
        import s3fs
        s3 = s3fs.S3FileSystem(endpoint_url=endpoint)
        s3.pipe_file(f"{BUCKET}/{key}", b"1")
        try:
            s3.pipe_file(f"{BUCKET}/{key}", b"2", mode="create")
            return {"create_only": False, "if_match": "no API"}
        except Exception as exc:
            return {"create_only": type(exc).__name__, "if_match": "no API"}
    return {"create_only": "no API (open_output_stream has no precondition)", "if_match": "no API"}


class PeakRss:
    """This process's peak RSS while the task runs, sampled every 5 ms (ru_maxrss would include the parent's peak:
    a forked child inherits its high-water mark)."""

    def __enter__(self) -> "PeakRss":
        import threading

        import psutil
        self.process, self.peak, self.done = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def child(args: argparse.Namespace) -> None:
    with PeakRss() as rss:
        record = run_task(args)
    record["peak_rss_mib"] = rss.peak / 2**20
    print(json.dumps(record))


def run_task(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    record: dict = {"library": args.library}
    if args.task == "read":
        record["rows"] = read_with(args.library, args.endpoint, args.key)
    elif args.task == "write":
        write_with(args.library, args.endpoint, args.parts, Path(args.payload).read_bytes())
    else:
        record.update(conditional_with(args.library, args.endpoint))
    record["seconds"] = time.perf_counter() - start
    return record


def run_child(task: str, library: str, endpoint: str, **extra) -> dict:
    cmd = [sys.executable, __file__, "--child", task, "--library", library, "--endpoint", endpoint]
    for name, value in extra.items():
        cmd += [f"--{name}", str(value)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **CREDENTIALS}, timeout=3600)
    if done.returncode != 0:
        return {"library": library, "error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--parts", type=int, default=16)
    parser.add_argument("--child", choices=["read", "write", "conditional"], help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.task = args.child
        return child(args)

    os.environ.update(CREDENTIALS)
    server, endpoint = start_server()
    try:
        import boto3
        import pyarrow.parquet as pq

        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory() as tmp:
            source, part = Path(tmp) / "input.parquet", Path(tmp) / "part.parquet"
            make_input(source, args.rows)
            pq.write_table(pq.read_table(source).slice(0, 4096), part)
            s3.upload_file(str(source), BUCKET, "input/prompts.parquet")
            size_mib = source.stat().st_size / 2**20
            print(f"input: {args.rows:,} rows, {size_mib:.1f} MiB on the server; part: {part.stat().st_size / 1024:.0f} KiB;"
                  f" server: moto {endpoint}")
            for library in ("pyarrow", "s3fs", "obstore"):
                read = run_child("read", library, endpoint, key="input/prompts.parquet")
                write = run_child("write", library, endpoint, parts=args.parts, payload=part)
                cond = run_child("conditional", library, endpoint)
                reading = read.get("error") or (f"{read['rows'] / read['seconds']:>9,.0f} rows/s "
                                                 f"({size_mib / read['seconds']:.0f} MiB/s, "
                                                 f"peak RSS {read['peak_rss_mib']:,.0f} MiB)")
                writing = write.get("error") or f"{args.parts / write['seconds']:.1f} parts/s"
                print(f"{library:8s} read {reading}\n{'':8s} write {writing}\n{'':8s} create-only put of an "
                      f"existing object: {cond.get('create_only', cond.get('error'))}; put on a stale ETag: "
                      f"{cond.get('if_match')}")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
