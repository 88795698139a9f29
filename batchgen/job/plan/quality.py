"""`batchgen plan --quality N`: the quality gate. N of the job's own rows (evenly spaced, as the calibration chooses
them: job/calibration.py) run greedily twice through the engine: with the job's settings (a calibrated int8 measured
first, as the run would), then with every quality lever off (engine_args.QUALITY_LEVERS: quantization, and whichever
of the other levers this engine has). The gate says how often the greedy texts agree, how often the `choice` labels
agree (jobs with choices), and the log-likelihood difference: per row, |the job's settings' log-likelihood - the
reference's| of the tokens both produced, over the rows whose texts agree (for a `choice` row, the reference label's
log-probability under each). Rows whose reference run holds a near-tie (two candidates within NEAR_TIE nats) flip
under any small change, so the agreement is also given over the rows the reference decides clearly. A calibrated int8 uses the output's `_calibration.json` when it holds this job's
calibration (the same fingerprint: what a run or its resume would use), and says so; else it measures one, as the run
would, and writes nothing."""
from __future__ import annotations

import dataclasses
import gc
import time
from types import SimpleNamespace
from typing import Any

from batchgen.engine.engine_args import QUALITY_LEVERS, EngineArgs

from ..calibration import calibrated_args, calibration_rows
from ..prepare import PreparedJob, engine_args_for


@dataclasses.dataclass
class RowOutcome:
    text: str
    logprob: float | None  # the row's generated tokens' total log-probability; for `choice`, each label's
    labels: dict[str, float] | None = None  # choice -> its total logprob (choice rows)
    margin: float | None = None  # how clearly greedy chose: the smallest gap in nats between a token's top two
    # candidates over the row's tokens; for a choice row, between its two most likely labels


NEAR_TIE = 0.25  # nats: a choice this close can flip under any change of kernel, batch or precision (two steps of
# bf16 logits between 16 and 32: a bf16 reference's logprob gaps come in such steps)


def levers_off(args: EngineArgs) -> tuple[EngineArgs, list[str]]:
    """`args` with every quality lever this EngineArgs has at its off value, and the names of those that were on."""
    present = {name: off for name, off in QUALITY_LEVERS.items() if hasattr(args, name)}
    on = [name for name, off in present.items() if getattr(args, name) != off]
    return dataclasses.replace(args, **present), on


def quality_gate(job: PreparedJob, rows: int) -> list[str]:
    """The gate's lines for the plan (job: inspect_job's)."""
    base = engine_args_for(job.config, rows, job.model, job.adapters)
    reference_args, on = levers_off(base)
    if not on:
        return [f"quality: no quality lever is set ({', '.join(QUALITY_LEVERS)}): the run is its own reference"]
    chosen = calibration_rows(job.inputs.total_rows, rows)
    started = time.monotonic()
    reference = _run(job, reference_args, chosen)
    scratch = SimpleNamespace(config=job.config, inputs=job.inputs, fingerprint=job.fingerprint, out=job.out,
                              calibration=None, calibration_source=None, write_calibration=False)
    measured = _run(job, calibrated_args(scratch, base), chosen)
    lines = agreement_lines(reference, measured, on)
    if scratch.calibration is not None:
        source = "read from the output's _calibration.json, this job's as a run reads it" \
            if scratch.calibration_source == "read" else "measured now, the output holds none for this job"
        lines.append(f"quality: calibration {source}: {scratch.calibration.get('activations', 'dynamic')} "
                     f"activations, kept {', '.join(scratch.calibration['keep'])} in the model's dtype")
    lines.append(f"quality: {len(chosen)} rows (evenly spaced), both runs {time.monotonic() - started:.1f} s")
    return lines


def agreement_lines(reference: dict[int, RowOutcome], measured: dict[int, RowOutcome], on: list[str]) -> list[str]:
    rows = sorted(set(reference) & set(measured))
    if not rows:
        return ["quality: no row of the sample built into a prompt"]
    same = [row for row in rows if reference[row].text == measured[row].text]
    lines = [f"quality: the job's {', '.join(on)} against the same rows with them off",
             f"quality: greedy text agrees on {len(same)}/{len(rows)} rows ({len(same) / len(rows):.1%})"]
    decided = [row for row in rows if reference[row].margin is not None and reference[row].margin >= NEAR_TIE]
    if len(decided) < len(rows):
        agree = sum(row in same for row in decided)
        lines.append(f"quality: {len(rows) - len(decided)} of these rows hold a near-tie in the reference (two "
                     f"candidates within {NEAR_TIE} nats), where any change of kernel or batch may flip them; on the "
                     f"{len(decided)} it decides clearly, {agree}/{len(decided)} agree"
                     + (f" ({agree / len(decided):.1%})" if decided else ""))
    labeled = [row for row in rows if reference[row].labels is not None]
    if labeled:
        agree = sum(reference[row].text == measured[row].text for row in labeled)
        lines.append(f"quality: choice labels agree on {agree}/{len(labeled)} rows ({agree / len(labeled):.1%})")
    diffs = []
    for row in rows:
        ref, got = reference[row], measured[row]
        if ref.labels is not None and got.labels is not None and ref.text in got.labels:
            diffs.append(abs(got.labels[ref.text] - ref.labels[ref.text]))
        elif ref.text == got.text and ref.logprob is not None and got.logprob is not None:
            diffs.append(abs(got.logprob - ref.logprob))
    if diffs:
        lines.append(f"quality: log-likelihood difference mean {sum(diffs) / len(diffs):.4f}, max {max(diffs):.4f} "
                     f"nats per row (over {len(diffs)} rows: the same text, or the reference's label)")
    else:
        lines.append("quality: log-likelihood difference: no row with the same text to compare")
    return lines


def _run(job: PreparedJob, args: EngineArgs, rows: list[int]) -> dict[int, RowOutcome]:
    """Each row's greedy outcome under `args` (one engine, freed after)."""
    from batchgen.engine import Request
    from batchgen.engine.engine import Engine

    from ..input.source import read_source

    engine = Engine(args)
    try:
        skip = bytearray(b"\x01") * job.inputs.total_rows
        for row in rows:
            skip[row] = 0
        requests = []
        for row in read_source(job.config, job.inputs, engine.tokenizer, engine.max_model_len, skip):
            if row.error is None and row.sampling is not None:
                params = dataclasses.replace(row.sampling, temperature=0.0, n=1, seed=None,
                                             logprobs=None if row.sampling.choice else 2)
                requests.append(Request(row.row, row.token_ids, params, lora=row.lora))
        return {result.request_id: _outcome(result) for result in engine.generate(requests)}
    finally:
        del engine
        gc.collect()


def _outcome(result: Any) -> RowOutcome:
    labels = None
    if result.choice_probs is not None and result.choice_logprobs is not None:
        labels = {choice: logprob for (choice, _), logprob in zip(result.choice_probs, result.choice_logprobs)}
    total = sum(result.logprobs) if result.logprobs else None
    if labels is not None:
        ranked = sorted(labels.values(), reverse=True)
        margin = ranked[0] - ranked[1] if len(ranked) > 1 else None
    else:
        gaps = [top[0][2] - top[1][2] for top in result.top_logprobs or [] if len(top) > 1]
        margin = min(gaps, default=None)
    return RowOutcome(result.text, total, labels, margin)
