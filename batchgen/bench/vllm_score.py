"""vLLM's CPU build scoring the rows (`--workload score`): each prompt's token logprobs as vLLM's `prompt_logprobs`
give them (`SamplingParams(max_tokens=1, prompt_logprobs=0)`: one token generated a row, which its time includes),
through the same worker and virtualenv as the generation bench's vllm system (vllm_system.py), on the model's fp32
conversion (loader.reference_model_dir), with batchgen's KV cache budget. Prefix caching off: a prompt's logprobs
are computed whole."""
from __future__ import annotations

from pathlib import Path

from .system_types import BenchOptions, SystemRun, TaskRowOutput
from .vllm_system import binding_log, launch_worker


def run(rows: list, options: BenchOptions) -> SystemRun:
    from batchgen.engine.engine_args import parse_bytes
    from batchgen.models.loader import reference_model_dir

    if not options.vllm_python:
        return SystemRun.unavailable("vllm", "no --vllm-python given (the Python of a virtualenv with vLLM)")
    if not Path(options.vllm_python).is_file():
        return SystemRun.unavailable("vllm", f"--vllm-python {options.vllm_python}: no such file")
    model_dir = reference_model_dir(options.engine_args.model)
    llm_kwargs = {"kv_cache_memory_bytes": parse_bytes(options.engine_args.cpu_kv_cache_memory()),
                  "max_model_len": max(len(row.token_ids) for row in rows) + 1}
    spec = {"python": options.vllm_python, "model_dir": str(model_dir), "enable_prefix_caching": False,
            "dtype": options.dtype, "llm_kwargs": llm_kwargs, "prompt_logprobs": True,
            "rows": [{"id": row.id, "prompt_token_ids": list(row.token_ids), "max_tokens": 1} for row in rows]}
    worker = launch_worker(spec, options.vllm_threads_bind)
    if worker.result is None:
        return SystemRun.unavailable("vllm", worker.failure, log_tail=worker.lines[-40:],
                                     omp_threads_bind=worker.bind)
    result = worker.result
    outputs = [TaskRowOutput(r["id"], r["prompt_logprobs"]) for r in result["rows"]]
    details = {"vllm_version": result["vllm_version"], "python": options.vllm_python, "llm_kwargs": llm_kwargs,
               "dtype": options.dtype, "model_dir": str(model_dir),
               "omp_threads_bind": worker.bind if worker.bind is not None else "vLLM's default",
               "omp_binding_log": binding_log(worker.lines), "process_s": worker.total_s}
    startup_s = result["ready_monotonic"] - worker.started if "ready_monotonic" in result else None
    return SystemRun("vllm", True, load_s=result["load_s"], wall_s=result["wall_s"], rows=outputs,
                     peak_rss_bytes=worker.peak_rss_bytes, details=details, startup_s=startup_s)
