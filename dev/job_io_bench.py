"""A job's own reading and writing through object storage against the local disk (issue 26, README "Object
storage"): the same ROWS-row input and output, once with both on this machine's disk and once with both on an
S3-protocol server (moto's, started here on 127.0.0.1), through batchgen's job layer — everything a run does but
generate:

- read: `prepare_job` (list, footers, every value of the job's columns decoded once, the output's lock or lease) and
  the source's record batches (`read_batches`, what feeds the tokenizer), rows/s;
- write: every row's result through PartWriter (run parts of output.rows_per_part rows, the ledger) and the final
  rewrite with _SUCCESS (finalize), rows/s;
- the peak RSS of the process doing it (each side runs in its own process).

The engine is left out on purpose (a 1M-row generation takes days on 2 cores): the results are made-up texts of
the output's shape (~60 words). moto's server is Python and itself the bottleneck: a real store is faster.

    python dev/job_io_bench.py [--rows 1000000]           # the table
    python dev/job_io_bench.py --sample [--repeats 3]      # the sample job end to end: local vs s3:// in and out
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tests/s3_server.py: moto's server


def one_side(input_path: str, output_path: str, rows: int) -> dict:
    """Read and write the job in this process; the figures as JSON."""
    from batchgen.engine.request import Result
    from batchgen.job import prepare_job
    from batchgen.job.config import parse_job
    from batchgen.job.input.source import read_batches
    from batchgen.job.output.final_rewrite import finalize
    from batchgen.job.output.part_writer import PartWriter
    from batchgen.job.output.parts import final_part_schema
    from batchgen.job.prepare import fingerprint_text

    config = parse_job({"model": "default", "input": {"path": input_path, "id_column": "id"},
                        "output": {"path": output_path}, "storage": {"lease_ttl_s": 60}})
    started = time.monotonic()
    job = prepare_job(config)
    read = sum(len(batch) for batch in read_batches(config, job.inputs, job.done))
    read_s = time.monotonic() - started
    assert read == rows, (read, rows)

    started = time.monotonic()
    fingerprint = fingerprint_text(job.fingerprint)
    writer = PartWriter(job.out, job.schema, fingerprint, config.output.rows_per_part, config.output.commit_interval_s,
                        sort_by_row=True)
    words = " ".join(["generated"] * 60)
    now = time.time()
    for row in range(rows):
        writer.add(row, row, (), Result(request_id=row, text=f"{row} {words}", token_ids=[1] * 64,
                                        finish_reason="length", error=None, prompt_tokens=40, output_tokens=64,
                                        cached_tokens=0, num_preemptions=0, arrival_time=now,
                                        first_scheduled_time=now, first_token_time=now, finish_time=now))
    writer.commit()
    finalize(job.out, final_part_schema(job.schema, fingerprint), rows, "input", config.output.rows_per_part,
             lambda totals: {"rows": totals.rows, "fingerprint": job.fingerprint})
    write_s = time.monotonic() - started
    job.release()
    return {"read_rows_per_s": rows / read_s, "write_rows_per_s": rows / write_s, "read_s": read_s,
            "write_s": write_s, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def make_input(path: Path, rows: int) -> None:
    """ROWS distinct prompts, as little compressible as prompts are: 20-60 words of a 5,000-word vocabulary."""
    import random
    import string

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    vocabulary = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9))) for _ in range(5000)]
    prompts = [" ".join(rng.choices(vocabulary, k=rng.randint(20, 60))) for _ in range(rows)]
    table = pa.table({"id": pa.array(range(rows), pa.int64()), "prompt": pa.array(prompts)})
    pq.write_table(table, path, row_group_size=65536)


def table(rows: int) -> None:
    from s3_server import start_s3_server

    server = start_s3_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "prompts.parquet"
            make_input(source, rows)
            size_mib = source.stat().st_size / 2**20
            client = server.client()
            client.create_bucket(Bucket="bench")
            client.upload_file(str(source), "bench", "in/prompts.parquet")
            results = {}
            for side, (input_path, output_path) in {
                    "local disk": (str(source), str(Path(tmp) / "out")),
                    "object store": ("s3://bench/in/prompts.parquet", "s3://bench/out")}.items():
                done = subprocess.run([sys.executable, __file__, "--one", input_path, output_path, "--rows", str(rows)],
                                      capture_output=True, text=True, env=server.env(), check=False)
                if done.returncode:
                    sys.exit(f"{side}: {done.stderr[-3000:]}")
                results[side] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{rows:,} rows ({size_mib:.1f} MiB input); "
              f"output.rows_per_part 1000")
        print("| where | read (rows/s) | write + final rewrite (rows/s) | peak RSS |")
        print("|---|---|---|---|")
        for side, r in results.items():
            print(f"| {side} | {r['read_rows_per_s']:,.0f} ({r['read_s']:.1f} s) | {r['write_rows_per_s']:,.0f} "
                  f"({r['write_s']:.1f} s) | {r['peak_rss_mib']:,.0f} MiB |")
        local, store = results["local disk"], results["object store"]
        print(f"object store / local: read {store['read_rows_per_s'] / local['read_rows_per_s']:.2f}x, "
              f"write {store['write_rows_per_s'] / local['write_rows_per_s']:.2f}x")
    finally:
        server.stop()


def sample(repeats: int) -> None:
    """The sample job (jobs/sample.yaml) from and to the local disk, then from and to s3://, alternating, wall time
    of `batchgen run` each (model load included)."""
    import yaml

    from s3_server import start_s3_server

    server = start_s3_server()
    walls: dict[str, list[float]] = {"local": [], "s3": []}
    try:
        client = server.client()
        client.create_bucket(Bucket="sample")
        client.upload_file(str(ROOT / "data" / "samples" / "prompts.parquet"), "sample", "in/prompts.parquet")
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(repeats):
                for side in ("local", "s3"):
                    job = yaml.safe_load((ROOT / "jobs" / "sample.yaml").read_text())
                    job["input"]["path"] = str(ROOT / "data" / "samples" / "prompts.parquet") if side == "local" \
                        else "s3://sample/in/prompts.parquet"
                    job["output"]["path"] = str(Path(tmp) / f"out-{i}") if side == "local" else f"s3://sample/out-{i}"
                    path = Path(tmp) / f"{side}-{i}.yaml"
                    path.write_text(yaml.safe_dump(job))
                    started = time.monotonic()
                    done = subprocess.run([sys.executable, "-m", "batchgen", "run", str(path), "--quiet"],
                                          capture_output=True, text=True, env=server.env())
                    if done.returncode:
                        sys.exit(f"{side}: {done.stderr[-3000:]}")
                    walls[side].append(time.monotonic() - started)
    finally:
        server.stop()
    local, store = statistics.median(walls["local"]), statistics.median(walls["s3"])
    print(f"sample job, `batchgen run` wall time, median of {repeats}: local {local:.2f} s, s3:// in and out "
          f"{store:.2f} s: +{store - local:.2f} s ({(store / local - 1) * 100:+.0f}%)")
    print(json.dumps(walls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--one", nargs=2, metavar=("INPUT", "OUTPUT"), help=argparse.SUPPRESS)
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.one:
        print(json.dumps(one_side(*args.one, args.rows)))
    elif args.sample:
        sample(args.repeats)
    else:
        table(args.rows)


if __name__ == "__main__":
    main()
