"""batchgen itself: the Engine over the rows, sorted by token ids as `batchgen run` sorts them (`sort: prefix`).
With `startup_probe`, its start-up is first measured in a fresh process (startup_probe.py), as vLLM's is."""
from __future__ import annotations

import dataclasses
import time

from .startup_probe import measure as measure_startup
from .step_phases import StepPhases
from .system_types import QUANTIZATION_LABELS, BenchOptions, RowOutput, SystemRun, elapsed


def run(rows: list, options: BenchOptions, prefix_caching: bool, choice: list[str] | None = None,
        startup_probe: bool = False, batch_invariant: bool = False) -> SystemRun:
    """With `choice`: every row is a labeling row answered by exact choice scoring over those labels (greedy), and
    its output is the label's tokens then EOS, as an unconstrained greedy answer of exactly that label would be.
    With `batch_invariant`: the engine's batch-invariant mode (its cost is batchgen's time against this one's)."""
    from batchgen.engine import Engine, Request, SamplingParams
    from batchgen.job.input.source import sort_windows

    name = "batchgen-choice" if choice else "batchgen-invariant" if batch_invariant else \
        "batchgen" if prefix_caching else "batchgen-nocache"
    if choice and any(row.kind != "labeling" for row in rows):
        return SystemRun.unavailable(name, "exact choice scoring answers labeling rows only (--workload labeling)")
    args = dataclasses.replace(options.engine_args, enable_prefix_caching=prefix_caching,
                               batch_invariant=batch_invariant or options.engine_args.batch_invariant)
    startup = measure_startup(args) if startup_probe else None
    started = time.monotonic()
    engine = Engine(args)
    load_s = elapsed(started)

    ordered = list(sort_windows(rows, window=len(rows) + 1, how="prefix"))  # the job source's sort, one window
    requests = [Request(row.id, row.token_ids, SamplingParams(max_tokens=row.max_tokens, temperature=0.0,
                                                              ignore_eos=options.ignore_eos, choice=choice or []))
                for row in ordered]
    started = time.monotonic()
    phases = StepPhases(engine)
    results = list(engine.generate(requests, on_step=phases))
    wall_s = elapsed(started)
    # Result times are wall-clock through the engine's own anchor: the run starts when the first request arrives.
    start_wall = min((r.arrival_time for r in results), default=0.0)

    errors = [r for r in results if r.finish_reason == "error"]
    if errors:
        return SystemRun.unavailable(name, f"{len(errors)} rows failed, e.g. row {errors[0].request_id}: "
                                           f"{errors[0].error}")
    end = [engine.eos_token_ids[0]] if choice else []
    outputs = [RowOutput(r.request_id, list(r.token_ids) + end,
                         None if r.first_token_time is None else r.first_token_time - start_wall,
                         r.finish_time - start_wall, r.cached_tokens) for r in results]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    cached_tokens = sum(r.cached_tokens for r in results)
    parameters = engine.num_parameters  # a tied lm_head is counted once
    details = {"engine_args": dataclasses.asdict(args), "parameters": parameters,
               "dtype": str(engine.dtype).removeprefix("torch."),
               "prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
               "quantization": QUANTIZATION_LABELS[args.quantization], "engine_stats": engine.stats(),
               "step_phases": phases.figures}
    if startup is not None:
        details["startup"] = startup
    if choice:
        details["label_token_ids"] = {label: engine.tokenizer.encode(label, add_special_tokens=False) + end
                                      for label in choice}
        details["mean_confidence"] = sum(max(p for _, p in r.choice_probs) for r in results) / len(results)
    return SystemRun(name, True, load_s=load_s, wall_s=wall_s, rows=outputs, details=details,
                     startup_s=startup["startup_s"] if startup is not None else None)
