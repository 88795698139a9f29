"""Rows/s and output tokens/s of one job under the local executor and under Ray with 1 and 2 replicas, each a whole
`batchgen run` (model loads and Ray's start-up included), one after another on this machine.

    PYTHONPATH=$PWD:$PWD/kernels python dev/ray_scaling.py [--rows 120] [--max-tokens 32] [--dtype auto]

The job: replies to the support tickets of data/samples/tickets.parquet (repeated up to --rows), greedy.
Configurations: local (torch on every core), ray 1 replica x every core, ray 2 replicas x 1 thread (Ray's own
processes share the same cores). On a 2-core machine the cores cap the gain: see docs/scaling.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parent.parent


def make_input(path: Path, rows: int) -> None:
    tickets = pq.read_table(ROOT / "data" / "samples" / "tickets.parquet").to_pylist()
    picked = [tickets[i % len(tickets)] for i in range(rows)]
    pq.write_table(pa.table({"id": list(range(rows)), "ticket": [f"{t['ticket']} (#{i})" for i, t in
                                                                 enumerate(picked)]}), path)


def run(root: Path, name: str, max_tokens: int, dtype: str, executor: dict | None) -> dict:
    job = {"model": "default", "dtype": dtype,
           "input": {"path": str(root / "in.parquet"), "id_column": "id",
                     "system_prompt": "You answer customer support tickets politely, in two sentences.",
                     "template": "Reply to this ticket: {ticket}"},
           "sampling": {"max_tokens": max_tokens, "temperature": 0.0},
           "engine": {"kv_cache_memory": "512MiB"},
           "output": {"path": str(root / name)}}
    if executor:
        job["executor"] = executor
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batchgen", "run", str(path), "--quiet"], capture_output=True,
                          text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((root / name / "_SUCCESS").read_text())
    replicas = summary.get("replicas", {})
    return {"name": name, "wall_s": wall, "rows": summary["rows"], "output_tokens": summary["output_tokens"],
            "rows_per_s": summary["rows"] / wall, "output_tokens_per_s": summary["output_tokens"] / wall,
            "replica_rows": {k: v["rows"] for k, v in replicas.items()},
            "generation_s": max((v["wall_s"] for v in replicas.values()), default=None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", help="write the figures as JSON here")
    options = parser.parse_args()
    cores = os.cpu_count() or 1
    configs = [("local", None),
               ("ray-1x", {"kind": "ray", "replicas": 1, "cpus_per_replica": cores}),
               ("ray-2x", {"kind": "ray", "replicas": 2, "cpus_per_replica": max(1, cores // 2)})]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_input(root / "in.parquet", options.rows)
        figures = [run(root, name, options.max_tokens, options.dtype, executor) for name, executor in configs]
    print(f"{options.rows} rows, max_tokens {options.max_tokens}, dtype {options.dtype}, {cores} cores")
    print("| run | wall s (whole run) | rows/s | output tok/s | generation s (replicas) | rows per replica |")
    print("|---|---|---|---|---|---|")
    for f in figures:
        generation = f"{f['generation_s']:.1f}" if f["generation_s"] is not None else "-"
        print(f"| {f['name']} | {f['wall_s']:.1f} | {f['rows_per_s']:.2f} | {f['output_tokens_per_s']:.1f} | "
              f"{generation} | {f['replica_rows'] or '-'} |")
    if options.out:
        Path(options.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
