"""What the job layer's newer pieces cost, each measured on its own:
- staging: a JSON lines input of N rows read into its Parquet copy (text_formats.stage), its time and the peak RSS of
  the process doing it (a fresh subprocess per size, so that the peaks are comparable);
- the report's row pass: ReportRows.add over N synthetic output rows in tables of 1,000, then the page drawn;
- the timeline's sample: one Engine.stats() call on the default model.

    python dev/job_overheads_bench.py [--rows 1000000] [--small 200000] [--report-rows 1000000]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = """
import resource, sys, time
from pathlib import Path
from batchgen.job.input.text_formats import stage
started = time.perf_counter()
staged = stage(Path(sys.argv[1]), "jsonl", Path(sys.argv[2]), 1024)
print(staged.rows, time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def staging(rows: int, tmp: Path) -> dict:
    source, cache = tmp / f"in-{rows}.jsonl", tmp / f"cache-{rows}"
    cache.mkdir()
    rng = random.Random(0)
    words = ["late", "refund", "broken", "login", "slow", "card"]
    with open(source, "w") as out:
        for i in range(rows):
            prompt = "Summarize this ticket: " + " ".join(rng.choice(words) for _ in range(30))
            out.write(json.dumps({"id": i, "prompt": prompt, "max_tokens": rng.choice([None, 16, 32])}) + "\n")
    done = subprocess.run([sys.executable, "-c", STAGE, str(source), str(cache)], capture_output=True, text=True,
                          check=True)
    count, seconds, peak = done.stdout.split()
    return {"rows": int(count), "file_mib": round(source.stat().st_size / 2**20, 1),
            "seconds": round(float(seconds), 2), "rows_per_s": round(int(count) / float(seconds)),
            "peak_rss_mib": round(int(peak) / 2**20)}


def report_rows(rows: int) -> dict:
    import numpy as np
    import pyarrow as pa

    from batchgen.job.report.page import ReportData, render
    from batchgen.job.report.rows import ReportRows

    rng = np.random.default_rng(0)

    def table(n: int) -> pa.Table:
        finish = np.where(rng.random(n) < 0.01, "error", "stop")
        return pa.table({"queue_s": rng.random(n), "ttft_s": rng.random(n), "tpot_s": rng.random(n) * 0.05,
                         "e2e_s": rng.random(n) * 10, "finish_reason": finish,
                         "error": [f"prompt is {i} tokens" if f == "error" else None for i, f in enumerate(finish)],
                         "prompt_tokens": rng.integers(1, 500, n), "output_tokens": rng.integers(1, 200, n),
                         "cached_tokens": rng.integers(0, 100, n)})

    tables = [table(1000) for _ in range(50)]
    gathered = ReportRows()
    started = time.perf_counter()
    while gathered.rows < rows:
        for t in tables:
            gathered.add(t)
    added = time.perf_counter() - started
    started = time.perf_counter()
    page = render([ReportData("bench", {"rows": gathered.rows, "wall_s": 100.0, "rows_this_run": gathered.rows},
                              None, gathered)])
    render_s = time.perf_counter() - started
    return {"rows": gathered.rows, "rows_per_s": round(gathered.rows / added), "render_s": round(render_s, 3),
            "page_kib": round(len(page) / 1024)}


def stats_call() -> dict:
    from batchgen.engine import Engine
    from batchgen.engine.engine_args import EngineArgs

    engine = Engine(EngineArgs(model="default", kv_cache_memory="64MiB", max_num_seqs=8))
    calls = 2000
    started = time.perf_counter()
    for _ in range(calls):
        engine.stats()
    return {"engine_stats_us": round((time.perf_counter() - started) / calls * 1e6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="JSON lines staged")
    parser.add_argument("--small", type=int, default=200_000, help="a smaller input, to show memory stays flat")
    parser.add_argument("--report-rows", type=int, default=1_000_000)
    args = parser.parse_args()
    from batchgen.machine import machine_info

    with tempfile.TemporaryDirectory() as tmp:
        result = {"staging": [staging(args.small, Path(tmp)), staging(args.rows, Path(tmp))],
                  "report_rows": report_rows(args.report_rows), **stats_call(),
                  "cpu_flags": [flag for flag, on in machine_info()["cpu_flags"].items() if on]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
