"""How many rows per second the writing side can take, with engines that answer instantly: where adding replicas
stops helping because the driver (Ray Data's transfer, unpickling, the part-file sink) is the bottleneck.

    PYTHONPATH=$PWD:$PWD/kernels python dev/driver_throughput.py [--rows 20000] [--replicas 2]

- local: the local executor's source (read, prompt, tokenize, sort) and sink with an instant engine: one process.
- alone: the driver's own work per row (unpickle a result, write it) on payloads made beforehand: its ceiling.
- ray: executor.kind ray with `--replicas` replicas whose engine answers instantly (they still read, build and
  tokenize their windows' prompts); the driver receives, unpickles and writes every row.
Each prints rows/s up to the last commit (the final rewrite and _SUCCESS excluded); for Ray also from the first row
written to the last, the rate the driver keeps up once the replicas run.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.engine import Result
from batchgen.job.config import parse_job
from batchgen.job.executors.ray import EngineReplica, run_on_ray
from batchgen.job.executors.local import stream_rows
from batchgen.job.prepare import engine_args_for, fingerprint_text, prepare_job
from batchgen.job.output.part_writer import PartWriter
from batchgen.job.input.source import read_source
from batchgen.models.loader import load_tokenizer, resolve_model


class InstantEngine:
    """What the job layer uses of an Engine, answering every request at once with 8 made-up tokens."""

    def __init__(self) -> None:
        self.tokenizer = load_tokenizer(resolve_model("default"))
        self.max_model_len = 8192
        self.args = type("Args", (), {"max_model_len": None})()
        self.kv_capacity = 1 << 20
        self.model = type("Model", (), {"max_model_len": 8192})()

    def generate(self, requests):
        now = time.time()
        for request in requests:
            yield Result(request_id=request.request_id, text="a made-up answer", token_ids=list(range(8)),
                         finish_reason="length", error=None, prompt_tokens=len(request.prompt_token_ids),
                         output_tokens=8, cached_tokens=0, num_preemptions=0, arrival_time=now,
                         first_scheduled_time=now, first_token_time=now, finish_time=now)

    def stats(self) -> dict:
        return {}


class InstantReplica(EngineReplica):
    def make_engine(self, engine_args):
        return InstantEngine()


def make_job(root: Path, rows: int, replicas: int) -> dict:
    prompts = [f"Summarize ticket {i}: the parcel {i % 97} arrived late and the box was damaged." for i in range(rows)]
    pq.write_table(pa.table({"id": list(range(rows)), "prompt": prompts}), root / "in.parquet")
    return {"input": {"path": str(root / "in.parquet"), "id_column": "id"}, "sampling": {"max_tokens": 8},
            "output": {"path": str(root / "out"), "rows_per_part": 1000},
            "executor": {"kind": "ray", "replicas": replicas, "cpus_per_replica": 1}}


def writer_for(prepared) -> PartWriter:
    config = prepared.config
    return PartWriter(prepared.out, prepared.schema, fingerprint_text(prepared.fingerprint),
                      config.output.rows_per_part, config.output.commit_interval_s, True)


def local(root: Path, rows: int) -> float:
    raw = make_job(root, rows, 1)
    raw["executor"]["kind"] = "local"
    prepared = prepare_job(parse_job(raw), overwrite=True)
    try:
        writer, engine = writer_for(prepared), InstantEngine()
        started = time.perf_counter()
        source = read_source(prepared.config, prepared.inputs, engine.tokenizer, engine.max_model_len, prepared.done)
        stream_rows(source, engine.generate, writer)
        writer.commit()
        return rows / (time.perf_counter() - started)
    finally:
        prepared.release()


def ray_run(root: Path, rows: int, replicas: int) -> tuple[float, float]:
    """rows/s from the start (Ray Data's and the replicas' start-up included), and from the first row written to
    the last (the driver's steady rate)."""
    prepared = prepare_job(parse_job(make_job(root, rows, replicas)), overwrite=True)
    try:
        writer = writer_for(prepared)
        written: list[float] = []

        def write(row, ident, keep, results, parse_json, replica):
            writer.add(row, ident, keep, *results, replica=replica)
            written.append(time.perf_counter())

        config = prepared.config
        import ray
        ray.init(include_dashboard=False, log_to_driver=False)
        try:
            started = time.perf_counter()
            run_on_ray(config, prepared.inputs, prepared.done, engine_args_for(config, rows), write,
                       replica_class=InstantReplica)
            writer.commit()
            end = time.perf_counter()
            return rows / (end - started), (rows - 1) / (end - written[0])
        finally:
            ray.shutdown()
    finally:
        prepared.release()


def driver_alone(root: Path, rows: int) -> float:
    """rows/s of the driver's own work per row, payloads made beforehand: unpickle and write (no Ray)."""
    import pickle

    prepared = prepare_job(parse_job(make_job(root, rows, 1)), overwrite=True)
    try:
        writer, engine = writer_for(prepared), InstantEngine()
        requests = [type("R", (), {"request_id": i, "prompt_token_ids": [1] * 40})() for i in range(rows)]
        payloads = [pickle.dumps((r.request_id, (), [r], True)) for r in engine.generate(requests)]
        started = time.perf_counter()
        for row, payload in enumerate(payloads):
            ident, keep, results, _ = pickle.loads(payload)
            writer.add(row, ident, keep, *results, replica=0)
        writer.commit()
        return rows / (time.perf_counter() - started)
    finally:
        prepared.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--replicas", type=int, default=2)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        local_rate = local(root / "local", options.rows) if (root / "local").mkdir() is None else 0.0
        (root / "alone").mkdir()
        alone_rate = driver_alone(root / "alone", options.rows)
        (root / "ray").mkdir()
        ray_rate, ray_steady = ray_run(root / "ray", options.rows, options.replicas)
    print(f"| writer | rows/s ({options.rows:,} rows, instant engines) |")
    print("|---|---|")
    print(f"| local executor (source + sink in one process) | {local_rate:,.0f} |")
    print(f"| ray executor, {options.replicas} instant replicas, start-up included | {ray_rate:,.0f} |")
    print(f"| ray executor, first row written to last (driver: transfer, unpickle, sink) | {ray_steady:,.0f} |")
    print(f"| the driver's own work per row alone (unpickle + sink, no Ray) | {alone_rate:,.0f} |")


if __name__ == "__main__":
    main()
