"""vLLM's CPU build, in its own virtualenv: `vllm_worker.py` runs under that Python (`--vllm-python`) on the same
rows and model directory, greedy, prefix caching on (vLLM's default), with batchgen's KV cache budget and dtype.
Memory is the worker's process tree.

vLLM at its best on a small machine: its CPU default binds one OMP thread per physical core less one core kept for
its scheduler process (on 2 cores: 1 thread). The worker runs with VLLM_CPU_OMP_THREADS_BIND set to every CPU this
process may run on instead (1.5-1.9x faster on this project's 2-core machine), unless told otherwise.

With batchgen's `quantization: int8` (W8A8: int8 weights, per-token int8 activations) vLLM runs the same int8 weights
as a compressed-tensors W8A8 checkpoint (vllm_checkpoint.py); `int8-weight-only` has no vLLM CPU counterpart.
Start-up (`startup_s`) is the worker process's spawn to its LLM being ready, as batchgen's (startup_probe.py)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .peak_rss import PeakRSS
from .system_types import QUANTIZATION_LABELS, BenchOptions, RowOutput, SystemRun, elapsed

WORKER = Path(__file__).with_name("vllm_worker.py")
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# vLLM gives up on a model step after 300 s (its RPC to the worker times out); a 2,048-token bf16 prefill of a 1B
# model on a CPU without native bf16 takes about that long. Raised unless the user set it.
STEP_TIMEOUT_ENV, STEP_TIMEOUT_S = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200"
# batchgen's quantization -> what vLLM runs for it (None: unquantized), and why the others have no counterpart
VLLM_QUANTIZATIONS = {None: None, "int8": "W8A8 int8: compressed-tensors, per-channel int8 weights (batchgen's "
                                          "own), dynamic per-token int8 activations, LM head unquantized"}
VLLM_QUANTIZATIONS_MISSING = {
    "int8-weight-only": "vLLM's CPU build has no int8 weight-only kernel (compressed-tensors W8A16 needs "
                        "CPUWNA16LinearKernel, which takes 4-bit weights only)"}


def threads_bind(setting: str) -> str | None:
    """The VLLM_CPU_OMP_THREADS_BIND value for a --vllm-threads-bind setting: 'all' (the default) binds every CPU
    this process may run on ('0-1'); 'default' leaves vLLM's own (None: the variable is not set); anything else
    is passed as is (vLLM's syntax: '0-3', '0,2-3')."""
    if setting == "default":
        return None
    if setting == "all":
        return cpu_list(os.sched_getaffinity(0))
    return setting


def cpu_list(cpus) -> str:
    """{0, 1, 2, 5, 7, 8} -> '0-2,5,7-8'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def binding_log(lines: list[str]) -> list[str]:
    """vLLM's log of its OMP thread binding (the bind setting, the cores of each rank, the reserved ones)."""
    kept, inside = [], False
    for line in lines:
        if "OpenMP thread binding info" in line:
            inside = True
        if inside:
            kept.append(line.strip())
            if "reserved_cpus" in line:
                inside = False
    return kept


@dataclass
class WorkerRun:
    result: dict | None  # the worker's OUT file; None: it failed
    failure: str | None  # why it failed
    lines: list[str]  # its log
    bind: str | None  # VLLM_CPU_OMP_THREADS_BIND as set (None: vLLM's default)
    started: float  # time.monotonic() at its spawn (the worker's ready_monotonic is on the same clock)
    total_s: float  # the worker process's spawn to exit
    peak_rss_bytes: int  # its process tree's


def launch_worker(spec: dict, threads_bind_setting: str) -> WorkerRun:
    """Run vllm_worker.py under --vllm-python (spec["python"]) on `spec`, watching its process tree's memory."""
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-vllm-") as tmp:
        in_path, out_path, log_path = Path(tmp, "in.json"), Path(tmp, "out.json"), Path(tmp, "worker.log")
        in_path.write_text(json.dumps(spec))
        bind = threads_bind(threads_bind_setting)
        env = {key: value for key, value in os.environ.items() if key != BIND_ENV}
        env.setdefault(STEP_TIMEOUT_ENV, STEP_TIMEOUT_S)
        if bind is not None:
            env[BIND_ENV] = bind
        started = time.monotonic()
        with open(log_path, "w") as log:
            # Its own session: vLLM's engine-core and worker processes outlive a worker that dies of an error,
            # and would keep both cores busy through the next system's run; they go with its process group.
            worker = subprocess.Popen([spec["python"], str(WORKER), str(in_path), str(out_path)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                with PeakRSS(worker.pid, children=True) as worker_rss:
                    code = worker.wait()
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.pid, signal.SIGKILL)
        total_s = elapsed(started)
        lines = log_path.read_text(errors="replace").strip().splitlines()
        if code != 0 or not out_path.is_file():
            return WorkerRun(None, f"worker exited with {code}: {lines[-1] if lines else 'no output'}", lines, bind,
                             started, total_s, worker_rss.peak)
        return WorkerRun(json.loads(out_path.read_text()), None, lines, bind, started, total_s,
                         worker_rss.peak)


def run(rows: list, options: BenchOptions) -> SystemRun:
    from batchgen.engine.engine_args import parse_bytes
    from batchgen.models.loader import reference_model_dir

    if not options.vllm_python:
        return SystemRun.unavailable("vllm", "no --vllm-python given (the Python of a virtualenv with vLLM)")
    if not Path(options.vllm_python).is_file():
        return SystemRun.unavailable("vllm", f"--vllm-python {options.vllm_python}: no such file")
    quantization = options.engine_args.quantization
    if quantization not in VLLM_QUANTIZATIONS:
        return SystemRun.unavailable("vllm", f"--quantization {quantization}: "
                                             f"{VLLM_QUANTIZATIONS_MISSING[quantization]}")
    model_dir = reference_model_dir(options.engine_args.model)  # a GGUF: its fp32 conversion
    if quantization == "int8":
        from .vllm_checkpoint import w8a8_checkpoint
        model_dir = w8a8_checkpoint(model_dir, options.dtype)
    # vLLM's CPU default sizes its KV cache from the machine's free memory (and fails when another process holds
    # some); it gets batchgen's budget instead, which also makes the comparison like for like.
    # Its context too: vLLM refuses a model whose whole context (131,072 tokens for Llama 3.2) the KV budget cannot
    # hold, where batchgen caps the context at what its pool holds. At the rows' longest need both serve every row.
    llm_kwargs = {"kv_cache_memory_bytes": parse_bytes(options.engine_args.cpu_kv_cache_memory()),
                  "max_model_len": options.engine_args.max_model_len
                  or max(len(row.token_ids) + row.max_tokens for row in rows)}
    spec = {"python": options.vllm_python, "model_dir": str(model_dir), "enable_prefix_caching": True,
            "ignore_eos": options.ignore_eos, "dtype": options.dtype, "llm_kwargs": llm_kwargs,
            "rows": [{"id": row.id, "prompt_token_ids": row.token_ids, "max_tokens": row.max_tokens}
                     for row in rows]}
    worker = launch_worker(spec, options.vllm_threads_bind)
    if worker.result is None:
        return SystemRun.unavailable("vllm", worker.failure, log_tail=worker.lines[-40:],
                                     omp_threads_bind=worker.bind)
    result, lines, bind, total_s = worker.result, worker.lines, worker.bind, worker.total_s

    outputs = [RowOutput(r["id"], r["token_ids"], r["first_token_s"], r["finish_s"], r["num_cached_tokens"])
               for r in result["rows"]]
    prompt_tokens = sum(len(row.token_ids) for row in rows)
    cached = [o.cached_tokens for o in outputs if o.cached_tokens is not None]
    details = {"vllm_version": result["vllm_version"], "python": options.vllm_python, "llm_kwargs": llm_kwargs,
               "dtype": options.dtype, "omp_threads_bind": bind if bind is not None else "vLLM's default",
               "omp_binding_log": binding_log(lines),
               "process_s": total_s,  # start-up, imports, load, generation and exit of the worker
               "quantization": QUANTIZATION_LABELS[quantization], "model_dir": str(model_dir),
               "quantization_detail": VLLM_QUANTIZATIONS[quantization],
               "vllm_quantization": result.get("quantization"),  # what vLLM itself says it ran
               "prefix_cache_hit_rate": sum(cached) / prompt_tokens if cached and prompt_tokens else None}
    startup_s = result["ready_monotonic"] - worker.started if "ready_monotonic" in result else None
    return SystemRun("vllm", True, load_s=result["load_s"], wall_s=result["wall_s"], rows=outputs,
                     peak_rss_bytes=worker.peak_rss_bytes, details=details, startup_s=startup_s)
