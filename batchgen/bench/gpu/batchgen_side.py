"""The GPU check's batchgen side, on the engine's request API: greedy outputs, output tokens/s on the offline
workload, and whole decode steps timed against their floor."""
from __future__ import annotations

import random
import statistics
import time
import types
from collections.abc import Iterable
from pathlib import Path

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams

from .device import max_memory_allocated, synchronize
from .shapes import decode_floor, decode_step_cost
from .shapes import ModelShape
from ..workloads import BenchRow


def open_engine(model_dir: Path, dtype: str, args, **overrides) -> tuple[Engine, dict]:
    """The engine on the check's settings (`args`), and what its start did: how long it took, its KV pool, its
    attention kernels and CUDA graphs. On CUDA an engine off the Triton kernels or without CUDA graphs is recorded
    as an error (the GPU path did not run as it should)."""
    settings = dict(model=str(model_dir), dtype=dtype, device=args.device, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_memory=args.kv_cache_memory, attention_backend=args.attention_backend)
    settings.update(overrides)
    started = time.perf_counter()
    engine = Engine(EngineArgs(**settings))
    info = {"load_s": time.perf_counter() - started, "dtype": dtype, "kv_cache_tokens": engine.kv_capacity,
            "kv_pool_reason": engine.kv_pool.reason, "max_model_len": engine.max_model_len,
            "attention_kernels": attention_kernels(engine), "cuda_graph_batch_sizes": cuda_graph_batch_sizes(engine)}
    if engine.device.type == "cuda":
        problems = []
        if info["attention_kernels"] != "batchgen_kernels.triton_backend":
            problems.append(f"the attention runs on {info['attention_kernels']}, not the Triton kernels")
        if info["cuda_graph_batch_sizes"] is None:
            problems.append("the engine runs without CUDA graphs (see the warning in its log)")
        if problems:
            info["error"] = "; ".join(problems)
    return engine, info


def attention_kernels(engine: Engine) -> str | None:
    """The module of the attention kernels the engine's layers call (batchgen_kernels.get_backend's choice)."""
    return next((m.backend.__name__ for m in engine.model.modules()
                 if isinstance(getattr(m, "backend", None), types.ModuleType)), None)


def cuda_graph_batch_sizes(engine: Engine) -> list[int] | None:
    """The batch sizes whose decode steps replay CUDA graphs; None when the engine decodes eagerly. Read from the
    engine's model runner: the request API does not say."""
    graphs = engine.runner.decode_graphs
    return None if graphs is None else graphs.sizes


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def abort_requests(engine: Engine, request_ids: Iterable) -> None:
    """Drop those of the requests still unfinished (a run cut short, a measurement done), giving back their KV
    blocks."""
    for request_id in request_ids:
        engine.abort(request_id)


def batchgen_greedy(engine: Engine, prompts: list[list[int]], max_tokens: int, together: bool) -> list[list[int]]:
    if together:
        results = {r.request_id: r for r in engine.generate(
            Request(i, prompt, greedy_params(max_tokens)) for i, prompt in enumerate(prompts))}
        return [results[i].token_ids for i in range(len(prompts))]
    return [next(iter(engine.generate([Request(0, prompt, greedy_params(max_tokens))]))).token_ids
            for prompt in prompts]


def batchgen_throughput(engine: Engine, rows: list[BenchRow], time_limit_s: float) -> dict:
    """Output tokens/s over the offline workload. Past time_limit_s the run stops at the next finished request;
    the requests still in flight are then dropped and their tokens not counted."""
    max_tokens = {row.id: row.max_tokens for row in rows}
    steps_before = engine.num_steps
    finished: set = set()
    output_tokens = errors = short = 0
    synchronize(engine.device)
    started = time.perf_counter()
    truncated = False
    results = engine.generate(Request(row.id, row.token_ids, greedy_params(row.max_tokens)) for row in rows)
    for result in results:
        finished.add(result.request_id)
        output_tokens += result.output_tokens
        errors += result.finish_reason == "error"
        short += result.finish_reason != "error" and result.output_tokens != max_tokens[result.request_id]
        if time.perf_counter() - started > time_limit_s:
            truncated = True
            break
    wall = time.perf_counter() - started
    if truncated:
        results.close()
        abort_requests(engine, (row.id for row in rows if row.id not in finished))
    return {"requests": len(rows), "finished": len(finished), "errors": errors, "wrong_length": short,
            "output_tokens": output_tokens, "output_tokens_of": "finished requests", "wall_s": wall,
            "output_tokens_per_s": output_tokens / wall, "steps": engine.num_steps - steps_before,
            "truncated_by_time_limit": truncated, "stats": engine.stats(),
            "max_memory_allocated_bytes": max_memory_allocated(engine.device)}


def decode_step_times(engine: Engine, shape: ModelShape, batch_size: int, context: int, steps: int, rates: dict,
                      seed: int) -> dict:
    """Time `steps` whole engine steps (schedule, inputs, forward, sampling, sync) once `batch_size` sequences with
    `context`-token prompts are all decoding, and set each against its floor."""
    rng = random.Random(seed)
    params = greedy_params(engine.max_model_len - context - 1)
    request_ids = [f"decode-{i}" for i in range(batch_size)]
    for request_id in request_ids:
        engine.add_request(Request(request_id, [rng.randrange(shape.vocab) for _ in range(context)], params))
    try:
        decoded = step_until_all_decode(engine, batch_size, params.max_tokens)
        # Each sequence has sampled one token at the end of its prefill and one per decode since; in a decode step
        # it reads its whole context, its last sampled token included.
        first_context = batch_size * (context + 1) + decoded
        contexts = [first_context + i * batch_size for i in range(steps)]
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()  # ends with the sampled ids copied to the host: a full device sync
            times.append(time.perf_counter() - started)
    finally:
        abort_requests(engine, request_ids)
    median = statistics.median(times)
    total_context = round(statistics.mean(contexts))
    cost = decode_step_cost(shape, batch_size, total_context)
    floor = decode_floor(cost, rates["copy_bandwidth_bytes_per_s"], rates["bf16_matmul_flops_per_s"])
    return {"batch_size": batch_size, "context": context, "steps": steps, "median_s": median,
            "mean_s": statistics.mean(times), "min_s": min(times), "max_s": max(times),
            "mean_total_context": total_context, **cost, **floor, "ratio_to_floor": median / floor["floor_s"]}


def step_until_all_decode(engine: Engine, batch_size: int, max_steps: int) -> int:
    """Step through the (chunked) prefill of the requests just added until a step decodes all `batch_size` of them
    and prefills nothing; the number of decodes in all those steps."""
    decoded = 0
    for _ in range(max_steps):
        finished = engine.step()
        if finished:
            raise RuntimeError(f"request {finished[0].request_id} finished while filling the batch: "
                               f"{finished[0].finish_reason} {finished[0].error or ''}".rstrip())
        stats = engine.last_step
        decoded += stats.num_decodes
        if stats.num_prefill_tokens == 0 and stats.num_decodes == batch_size:
            return decoded
    raise RuntimeError(f"the {batch_size} requests were not all decoding after {max_steps} steps")
