"""batchgen in a prefill-only workload: the engine `open_engine` picks for the model (EncoderEngine for the BERT
family, Engine for a decoder) with the workload's task, driven through its public API over the rows sorted as a job
sorts them. Score asks for each token's logprob (PoolingParams.token_logprobs) to compare them with the others'."""
from __future__ import annotations

import dataclasses
import time

from .system_types import BenchOptions, SystemRun, TaskRowOutput, elapsed


def run(rows: list, options: BenchOptions) -> SystemRun:
    from batchgen.engine import PoolingParams, Request, open_engine
    from batchgen.job.input.source import sort_windows

    args = options.engine_args
    task = args.task
    started = time.monotonic()
    engine = open_engine(args)
    load_s = elapsed(started)

    how = "prefix" if task == "score" else "length"  # a decoder's prefix cache; an encoder's padding
    ordered = list(sort_windows(rows, window=len(rows) + 1, how=how))
    pooling = PoolingParams(score_from=1, token_logprobs=True) if task == "score" else PoolingParams()
    requests = [Request(row.id, list(row.token_ids), pooling_params=pooling) for row in ordered]
    started = time.monotonic()
    results = list(engine.generate(requests))
    wall_s = elapsed(started)

    errors = [r for r in results if r.finish_reason == "error"]
    if errors:
        return SystemRun.unavailable("batchgen", f"{len(errors)} rows failed, e.g. row {errors[0].request_id}: "
                                                 f"{errors[0].error}")
    outputs = [TaskRowOutput(r.request_id, list(values_of(r, task)), r.label) for r in results]
    dtype = getattr(engine, "dtype", None)
    details = {"engine": type(engine).__name__, "engine_args": dataclasses.asdict(args),
               "dtype": str(dtype).removeprefix("torch.") if dtype is not None else args.dtype,
               "truncated_tokens": sum(r.num_truncated_tokens for r in results), "engine_stats": engine.stats()}
    parameters = getattr(engine, "num_parameters", None)
    if parameters is not None:
        details["parameters"] = parameters
    return SystemRun("batchgen", True, load_s=load_s, wall_s=wall_s, rows=outputs, details=details)


def values_of(result, task: str) -> list[float]:
    if task == "embed":
        return result.embedding
    if task == "classify":
        return result.probs
    return result.prompt_logprobs
