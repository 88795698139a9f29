"""The streaming path (read in record batches -> build + tokenize -> sort within a window -> lazy pull ->
part files -> final rewrite in input order) keeps memory flat over a million rows.

The engine is replaced by a function that turns each request into a result at once, and the tokenizer by a
byte-level one: this measures the job layer's streaming, not generation. It runs in a fresh subprocess so that
its peak RSS is its own."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import json, sys, threading, time
    from pathlib import Path

    import psutil
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.engine.request import Result
    from batchgen.job.config import parse_job
    from batchgen.job.executors.local import stream_rows
    from batchgen.job.prepare import PreparedJob, job_fingerprint, fingerprint_text
    from batchgen.job.output.final_rewrite import finalize
    from batchgen.job.output.part_writer import PartWriter
    from batchgen.job.output.output_dir import OutputDir
    from batchgen.job.input.files import inspect_input
    from batchgen.job.input.source import read_source

    N, root = int(sys.argv[1]), Path(sys.argv[2])
    CHUNK = 100_000
    with pq.ParquetWriter(root / "in.parquet", pa.schema([("prompt", pa.string()), ("tag", pa.int64())])) as w:
        for start in range(0, N, CHUNK):
            ids = range(start, min(start + CHUNK, N))
            w.write_table(pa.table({"prompt": [f"q{(i * 7919) % 1000} item {i}" for i in ids],
                                    "tag": list(ids)}), row_group_size=CHUNK)

    class ByteTokenizer:  # stands in for the HF tokenizer: one token per byte
        def __call__(self, texts, add_special_tokens):
            return {"input_ids": [list(t.encode()) for t in texts]}

    def instant(requests):  # stands in for the engine: every request finishes at once
        for r in requests:
            now = time.time()
            yield Result(request_id=r.request_id, text="ok", token_ids=[1], finish_reason="length", error=None,
                         prompt_tokens=len(r.prompt_token_ids), output_tokens=1, cached_tokens=0, num_preemptions=0,
                         arrival_time=now, first_scheduled_time=now, first_token_time=now, finish_time=now)

    config = parse_job({"input": {"path": str(root / "in.parquet"), "chat_template": False, "sort_window": 10_000,
                                  "sort": "prefix"},
                        "output": {"path": str(root / "out"), "keep_columns": ["tag"], "rows_per_part": 50_000}})
    inputs = inspect_input(config)
    job = PreparedJob(config, inputs, job_fingerprint(config, "stand-in", inputs), OutputDir(root / "out"))
    job.out.path.mkdir()
    job.out.prepare_tmp()
    process = psutil.Process()
    baseline = process.memory_info().rss
    samples, seen, highest = [], [0], [baseline]
    running = threading.Event()
    running.set()

    def watch():  # the highest RSS between samples, final rewrite included
        while running.is_set():
            highest[0] = max(highest[0], process.memory_info().rss)
            time.sleep(0.01)

    def sample(result):
        seen[0] += 1
        if seen[0] % 100_000 == 0:
            samples.append(max(highest[0], process.memory_info().rss))
            highest[0] = 0

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    writer = PartWriter(job.out, job.schema, fingerprint_text(job.fingerprint), 50_000, 1e9, True)
    stream_rows(read_source(config, inputs, ByteTokenizer(), None), instant, writer, sample)
    writer.commit()
    summary = finalize(job.out, job.schema, N, "input", 50_000, lambda totals: {"rows": totals.rows})
    samples.append(max(highest[0], process.memory_info().rss))  # the final rewrite
    running.clear()
    watcher.join()
    print(json.dumps({"baseline": baseline, "samples": samples, "rows": summary["rows"],
                      "seconds": time.monotonic() - started}))
''')

MB = 2**20


@pytest.mark.slow
def test_million_rows_stream_in_flat_memory(tmp_path):
    n = 1_000_000
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(n), str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rows"] == n
    samples, baseline = report["samples"], report["baseline"]
    print(f"{n} rows in {report['seconds']:.1f} s; highest RSS over baseline per 100k rows, then in the final "
          f"rewrite (MB):", [round((s - baseline) / MB) for s in samples])
    assert len(samples) == n // 100_000 + 1
    assert max(samples) - baseline < 200 * MB
    # flat: what the first 100k rows needed is all the rest needs (allocator noise aside)
    assert max(samples) - samples[0] < 60 * MB

    import pyarrow.dataset as ds
    out = ds.dataset(tmp_path / "out").to_table(columns=["id", "tag"])
    assert out.num_rows == n
    assert out["id"].to_pylist() == list(range(n)) and out["tag"].to_pylist() == list(range(n))
