"""`batchgen plan`'s time estimate where no bench record describes this machine: a probe of a few seconds on the
job's own model and rows, in the plan's process, through the engine's public request API (add_request, step,
abort) and nothing else of it.

The engine starts as the run's would (the job's engine settings for the rows left). Its requests are the first rows
of the plan's sample in the run's order (after the sort), as many as the batch the run decodes at (max_num_seqs, the
rows, what the KV pool holds; the rows again from the first where the sample has fewer), greedy and ignoring EOS so
that the batch stays full. The first step computes one prefill chunk (max_num_batched_tokens of their prompts, less
what the prefix cache serves): seconds per prompt token computed. The steps after it finish their prompts; then
steps in which every request decodes one token, at least DECODE_STEPS of them and DECODE_SECONDS in all (at most
MAX_DECODE_STEPS): seconds per output token at that batch, the median step's (a mean would take a stall of a few
steps, another process's, for the machine's rate). Then every request is aborted and the engine dropped. Prompts
whose sum would pass PREFILL_CHUNKS chunks are cut to fit (the plan says so): the probe stays short, and decodes at
shorter contexts than the job's.

The estimate is the job's computed prompt tokens and `choice` candidates' tokens at the prefill rate plus its other
output tokens at the decode rate, every figure the plan's for the whole job. As with a bench record, every row is
taken to run to its max_tokens in a full batch: rows that stop early (EOS) make the run shorter, a batch that thins
out at the job's end makes it longer. Added to it: the model load (the probe's engine start, less a kernel build)
and, from the CLI, the start-up (this process's age when the probe began: the run's imports and input reading are
the same). tests/test_plan_probe.py holds the sum to within 2x of a real run's wall time on the sample job.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ..prepare import engine_args_for
from ..runner import kernel_build_seconds
from .throughput import TimeEstimate

DECODE_STEPS, DECODE_SECONDS, MAX_DECODE_STEPS = 8, 2.0, 48  # the timed steps in which every request decodes
PREFILL_CHUNKS = 4  # the requests' prompts: at most this many max_num_batched_tokens chunks in all, cut to fit


@dataclass(frozen=True)
class ProbeResult:
    """What the probe measured."""

    load_s: float  # the engine's start-up, less a kernel build in it: what the run's model load takes
    kernel_build_s: float  # the C++ CPU kernels compiled during the start-up (once per machine; 0.0 when cached)
    chunk_tokens: int  # prompt tokens computed in the first step (one prefill chunk)
    per_prompt_token: float  # seconds
    batch: int  # sequences decoding in the timed decode steps
    decode_steps: int
    per_output_token: float  # seconds, at that batch
    cut_to: int | None  # the length the prompts were cut to, where they were
    wall_s: float  # the whole probe, the start-up included
    spec_acceptance: float | None = None  # speculative decoding: the share of guesses that stood in the probe


class ProbeFailed(RuntimeError):
    """The probe ran but timed no prefill or no decode step (every request refused, say)."""


def probe_time(config, model: str, rows_left: int, prompts: list[list[int]], batch: int, computed: float,
               output: float, scored: float, no_record: str, process_started: float | None = None) -> TimeEstimate:
    """The time estimate from a probe. `model`: the model directory the plan resolved; `prompts`: the token ids of
    the sample's first rows in the run's order; `batch`: the run's decode batch; `computed`, `output`, `scored`: the
    whole job's prompt tokens to compute (less the prefix cache's), output tokens (their bound) and, of those, the
    tokens `choice` candidates compute; `no_record`: why no bench record served; `process_started`: when this
    process started (epoch seconds), where it is the CLI's: what it did before the probe (interpreter, imports, the
    job and its input read, a sample tokenized) is what the run does before its engine, so its time is the run's
    start-up."""
    startup_s = None if process_started is None else max(time.time() - process_started, 0.0)
    try:
        found = run_probe(engine_args_for(config, rows_left, model), prompts, batch)
    except ProbeFailed as exc:
        return TimeEstimate(None, None, f"{no_record}; the time probe failed: {exc}", probed=True)
    except Exception as exc:  # noqa: BLE001 -- the engine's start failed: the run would say so; the plan goes on
        text = (str(exc).strip().splitlines() or [""])[0]
        return TimeEstimate(None, None, f"{no_record}; the time probe failed: {type(exc).__name__}: {text}",
                            probed=True)
    seconds = (computed + scored) * found.per_prompt_token + max(output - scored, 0.0) * found.per_output_token
    how = (f"{found.per_prompt_token * 1e3:.2f} ms per prompt token computed (a {found.chunk_tokens:,}-token prefill "
           f"chunk), {found.per_output_token * 1e3:.2f} ms per output token ({found.decode_steps} decode steps at "
           f"batch {found.batch})")
    return TimeEstimate(seconds, found.load_s, how, (), found, probed=True, startup_s=startup_s)


def trust_lines(found: ProbeResult) -> list[str]:
    """What the plan says of a probe: that it is one, and how far to trust it."""
    lines = [f"a probe, not a bench record (none for this machine): the job's first rows, {found.batch:,} at once, "
             f"timed just now, {found.wall_s:.1f} s with the model load (--no-probe skips it)",
             "rough: it takes every row to its max_tokens at a full batch, so rows that stop early make the run "
             "shorter, a batch thinning out at the end longer; on the sample job it came within 2x of the run"]
    if found.cut_to is not None:
        lines.append(f"the probe's prompts were cut to {found.cut_to:,} tokens to keep it short: the job's longer "
                     f"contexts decode slower than it measured")
    if found.spec_acceptance is not None:
        lines.append(f"speculative decoding in the probe: {found.spec_acceptance:.0%} of the guessed tokens stood "
                     f"(on its greedy rows; the rate is in the estimate)")
    if found.kernel_build_s:
        lines.append(f"the probe first compiled the C++ CPU kernels ({found.kernel_build_s:.1f} s, once per machine: "
                     f"the run finds them cached; not in the estimate)")
    return lines


def run_probe(args, prompts: list[list[int]], batch: int) -> ProbeResult:
    """Start an engine with `args`, time one prefill chunk and the decode steps of `batch` requests made of
    `prompts` (cycled), abort them and drop the engine."""
    from batchgen.engine import Engine

    started = time.perf_counter()
    built = kernel_build_seconds()
    engine = Engine(args)
    kernel_build_s = kernel_build_seconds() - built
    load_s = time.perf_counter() - started - kernel_build_s
    try:
        chosen, cut_to = _requests(prompts, batch, args.max_num_batched_tokens, engine.max_model_len)
        chunk_tokens, chunk_s, steps, refused = _time_steps(engine, chosen, args.max_num_batched_tokens)
        acceptance = engine.stats()["spec_acceptance_rate"]
    finally:
        del engine
        gc.collect()  # the weights and the KV pool go now, not when the plan's process ends
    if not chunk_tokens:
        raise ProbeFailed(f"the engine refused its requests: {refused}" if refused else
                          "its first step computed no prompt token")
    if not steps:
        raise ProbeFailed("no step in which every request decoded")
    per_output = statistics.median(seconds / tokens for seconds, _, tokens in steps)
    return ProbeResult(load_s, kernel_build_s, chunk_tokens, chunk_s / chunk_tokens, max(d for _, d, _ in steps),
                       len(steps), per_output, cut_to, time.perf_counter() - started, acceptance)


def _requests(prompts: list[list[int]], batch: int, chunk: int, context: int) -> tuple[list[list[int]], int | None]:
    """`batch` prompts, the sample's cycled, each leaving room for the tokens the probe decodes; all cut to one
    length where together they would pass PREFILL_CHUNKS chunks."""
    room = max(context - MAX_DECODE_STEPS - 2 * PREFILL_CHUNKS - 2, 1)
    chosen = [prompts[i % len(prompts)][:room] for i in range(max(batch, 1))]
    budget = PREFILL_CHUNKS * chunk
    if sum(map(len, chosen)) <= budget:
        return chosen, None
    cut_to = max(budget // len(chosen), 1)
    return [ids[:cut_to] for ids in chosen], cut_to


def _time_steps(engine, prompts: list[list[int]], chunk: int) -> tuple[int, float, list[tuple[float, int]], str]:
    """(prompt tokens of the first step, its seconds, [(seconds, sequences, tokens) of each timed decode step: with
    speculative decoding a step may make more tokens than it has sequences], why the engine refused a request (""
    when it refused none))."""
    from batchgen.engine import Request, SamplingParams

    # enough tokens for every prefill step the prompts can take, and the decode steps after them
    most = -(-sum(map(len, prompts)) // chunk) + len(prompts) + MAX_DECODE_STEPS + 2
    ids: list[Any] = [("probe", i) for i in range(len(prompts))]
    for request_id, tokens in zip(ids, prompts):
        params = SamplingParams(max_tokens=most, temperature=0.0, ignore_eos=True)
        engine.add_request(Request(request_id, tokens, params))
    chunk_tokens, chunk_s, decodes, refused = 0, 0.0, [], ""
    try:
        for step in range(most):
            started, sampled = time.perf_counter(), engine.num_sampled_tokens
            results = engine.step()
            seconds = time.perf_counter() - started
            refused = refused or next((r.error or "?" for r in results if r.finish_reason == "error"), "")
            shape = engine.last_step
            if shape is None or not engine.has_unfinished():
                break
            if step == 0:  # nothing decodes yet: a pure prefill step
                chunk_tokens, chunk_s = shape.num_prefill_tokens, seconds
            elif shape.num_prefill_tokens == 0 and shape.num_decodes:
                decodes.append((seconds, shape.num_decodes, engine.num_sampled_tokens - sampled))
                timed = sum(s for s, _, _ in decodes)
                if len(decodes) >= MAX_DECODE_STEPS or (len(decodes) >= DECODE_STEPS and timed >= DECODE_SECONDS):
                    break
    finally:
        for request_id in ids:
            engine.abort(request_id)
    return chunk_tokens, chunk_s, decodes, refused

