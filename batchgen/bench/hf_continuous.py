"""transformers' own continuous batching (`init_continuous_batching`: a manager thread over a paged cache), one
request per row with its own max_new_tokens. Versions without it, or a run that fails, are reported unavailable.
On the CPU it can be pathologically slow, so the run is time-boxed: past the limit it is stopped and reported
unavailable with what it managed."""
from __future__ import annotations

import time

from .system_types import BenchOptions, RowOutput, SystemRun, elapsed


def run(rows: list, options: BenchOptions) -> SystemRun:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from batchgen.models.loader import eos_token_ids, load_tokenizer, reference_model_dir

    started = time.monotonic()
    model_dir = reference_model_dir(options.engine_args.model)  # a GGUF: its fp32 conversion
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, options.hf_dtype)).eval()
    if not hasattr(model, "init_continuous_batching"):
        import transformers
        return SystemRun.unavailable("hf-continuous", f"transformers {transformers.__version__} has no "
                                                      f"continuous batching (init_continuous_batching)")
    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model_dir, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else eos[0]
    config = GenerationConfig(do_sample=False, max_new_tokens=max(row.max_tokens for row in rows),
                              eos_token_id=None if options.ignore_eos else eos, pad_token_id=pad)
    manager = model.init_continuous_batching(generation_config=config, **cache_size(model, options))
    if hasattr(manager, "warmup"):  # allocates the paged cache up front, so that it counts as loading
        manager.warmup()
    manager.start()
    load_s = elapsed(started)

    limit_s = options.hf_continuous_time_limit_s
    clock_start, started = time.perf_counter(), time.monotonic()  # the manager's timestamps are perf_counter
    try:
        with torch.inference_mode():
            for row in rows:
                add_request(manager, row)
            finished = collect(manager, len(rows), started + limit_s)
    finally:
        stop(manager)
    wall_s = elapsed(started)

    if len(finished) < len(rows):
        tokens = sum(len(out.generated_tokens) for out in finished.values())
        return SystemRun.unavailable(
            "hf-continuous", f"too slow on this machine: {len(finished)} of {len(rows)} rows ({tokens} output "
                             f"tokens) finished in the {limit_s:.0f} s time limit",
            load_s=load_s, rows_finished=len(finished), output_tokens=tokens, dtype=options.hf_dtype)
    failed = [out for out in finished.values() if getattr(out, "error", None)]
    if failed:
        return SystemRun.unavailable("hf-continuous", f"{len(failed)} requests failed, e.g.: {failed[0].error}")
    outputs = [row_output(int(request_id), out, clock_start) for request_id, out in finished.items()]
    return SystemRun("hf-continuous", True, load_s=load_s, wall_s=wall_s, rows=outputs,
                     details={"dtype": options.hf_dtype})


def cache_size(model, options: BenchOptions) -> dict:
    """The paged cache sized to batchgen's KV budget on the CPU (kv_pool.kv_cache_budget), at the model's KV bytes
    per token (engine_plan.kv_bytes_per_token, every layer: transformers' cache has no sliding-window group): on the
    CPU its default takes most of the machine's memory (and a long time to allocate). Versions without
    ContinuousBatchingConfig keep their defaults."""
    from batchgen.engine.engine_plan import kv_bytes_per_token
    from batchgen.engine.kv_pool import kv_cache_budget
    from batchgen.models.inspector import describe_config

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return {}
    bytes_per_token = kv_bytes_per_token(describe_config(model.config), model.dtype)  # K and V
    page_size = getattr(ContinuousBatchingConfig(), "page_size", 256)  # tokens per block
    budget, _ = kv_cache_budget(options.engine_args, "cpu")
    num_blocks = max(1, budget // (bytes_per_token * page_size))
    return {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=num_blocks)}


def add_request(manager, row) -> None:
    try:
        manager.add_request(row.token_ids, request_id=str(row.id), max_new_tokens=row.max_tokens,
                            record_timestamps=True)
    except TypeError:  # versions without per-token timestamps
        manager.add_request(row.token_ids, request_id=str(row.id), max_new_tokens=row.max_tokens)


def collect(manager, count: int, deadline: float) -> dict:
    """Finished outputs by request id, until `count` have finished or the deadline passes."""
    finished: dict = {}
    while len(finished) < count and time.monotonic() < deadline:
        result = manager.get_result(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped unexpectedly")
            continue
        if result.is_finished():
            finished[result.request_id] = result
    return finished


def stop(manager) -> None:
    """Stop the manager's thread, failing whatever has not finished (after the time limit)."""
    try:
        manager.stop(block=True, timeout=30, hard_stop=True)
    except TypeError:  # versions without hard_stop
        manager.stop(block=True, timeout=30)


def row_output(row_id: int, out, clock_start: float) -> RowOutput:
    stamps = getattr(out, "timestamps", None)
    first = stamps[0] - clock_start if stamps else None
    finish = stamps[-1] - clock_start if stamps else None
    return RowOutput(row_id, list(out.generated_tokens), first, finish)
