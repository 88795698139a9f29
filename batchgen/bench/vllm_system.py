"""vLLM's CPU build, in its own virtualenv: `vllm_worker.py` runs under that Python (`--vllm-python`) on the same
rows and model directory, greedy, prefix caching on (vLLM's default), with batchgen's KV cache budget. Memory is the
worker's process tree."""
from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

from .peak_rss import PeakRSS
from .system_types import BenchOptions, RowOutput, SystemRun, elapsed

WORKER = Path(__file__).with_name("vllm_worker.py")


def run(rows: list, options: BenchOptions) -> SystemRun:
    from batchgen.engine.engine_args import parse_bytes
    from batchgen.models.loader import resolve_model

    if not options.vllm_python:
        return SystemRun.unavailable("vllm", "no --vllm-python given (the Python of a virtualenv with vLLM)")
    if not Path(options.vllm_python).is_file():
        return SystemRun.unavailable("vllm", f"--vllm-python {options.vllm_python}: no such file")
    # vLLM's CPU default sizes its KV cache from the machine's free memory (and fails when another process holds
    # some); it gets batchgen's budget instead, which also makes the comparison like for like.
    llm_kwargs = {"kv_cache_memory_bytes": parse_bytes(options.engine_args.cpu_kv_cache_memory())}
    spec = {"model_dir": str(resolve_model(options.engine_args.model)), "enable_prefix_caching": True,
            "llm_kwargs": llm_kwargs,
            "rows": [{"id": row.id, "prompt_token_ids": row.token_ids, "max_tokens": row.max_tokens}
                     for row in rows]}
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-vllm-") as tmp:
        in_path, out_path, log_path = Path(tmp, "in.json"), Path(tmp, "out.json"), Path(tmp, "worker.log")
        in_path.write_text(json.dumps(spec))
        started = time.monotonic()
        with open(log_path, "w") as log:
            worker = subprocess.Popen([options.vllm_python, str(WORKER), str(in_path), str(out_path)],
                                      stdout=log, stderr=subprocess.STDOUT)
            with PeakRSS(worker.pid, children=True) as worker_rss:
                code = worker.wait()
        total_s = elapsed(started)
        if code != 0 or not out_path.is_file():
            lines = log_path.read_text(errors="replace").strip().splitlines()
            return SystemRun.unavailable("vllm", f"worker exited with {code}: {lines[-1] if lines else 'no output'}",
                                         log_tail=lines[-40:])
        result = json.loads(out_path.read_text())

    outputs = [RowOutput(r["id"], r["token_ids"], r["first_token_s"], r["finish_s"], r["num_cached_tokens"])
               for r in result["rows"]]
    prompt_tokens = sum(len(row.token_ids) for row in rows)
    cached = [o.cached_tokens for o in outputs if o.cached_tokens is not None]
    details = {"vllm_version": result["vllm_version"], "python": options.vllm_python, "llm_kwargs": llm_kwargs,
               "process_s": total_s,  # start-up, imports, load, generation and exit of the worker
               "prefix_cache_hit_rate": sum(cached) / prompt_tokens if cached and prompt_tokens else None}
    return SystemRun("vllm", True, load_s=result["load_s"], wall_s=result["wall_s"], rows=outputs,
                     peak_rss_bytes=worker_rss.peak, details=details)
