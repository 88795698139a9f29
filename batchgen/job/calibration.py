"""`engine.quantization_calibration: {rows: N}` with `quantization: int8`: which layers the run keeps in the model's
dtype, measured on N of the job's own rows (engine/calibration.py) before the quantized engine loads.

The rows are evenly spaced over the input (row i * total // N, i < N: the same rows on every run of the job) and
built as the run builds them. The measurement is written beside the output (`_calibration.json`, marked
batchgen-calibration/1, with the job's fingerprint) before any row runs: a resumed run reads it back and keeps the
same layers, whatever a new measurement would say (timing noise does not enter it, but thread counts can move a
layer across the threshold). With activations static or smooth the record also holds each layer's static input scale
or smoothing factors (`activation_scales`), which the quantized engine is built with (EngineArgs.quantization_scales).
`_SUCCESS` gets the rows, the activations, the layers kept and the sensitivities (calibration_summary)."""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
from typing import Any

from batchgen.engine.engine_args import EngineArgs

from .output.parts import CALIBRATION, SIDE_FILE_MARKS
from .prepare import PreparedJob, fingerprint_text

logger = logging.getLogger("batchgen")
FORMAT = SIDE_FILE_MARKS[CALIBRATION] + "1"


def calibration_rows(total_rows: int, n: int) -> list[int]:
    """The job's rows the calibration reads: n evenly spaced positions (all rows when n >= total_rows)."""
    n = min(n, total_rows)
    return [i * total_rows // n for i in range(n)]


def read_rows(config, inputs, tokenizer, max_model_len: int | None, rows: list[int]) -> list[tuple[int, list[int]]]:
    """(row, token ids) of those of `rows` that build into a prompt, in row order, built as the run builds them."""
    from .input.source import read_source

    skip = bytearray(b"\x01") * inputs.total_rows
    for row in rows:
        skip[row] = 0
    built = read_source(config, inputs, tokenizer, max_model_len, skip)
    return sorted((row.row, list(row.token_ids)) for row in built if row.error is None and row.token_ids)


def calibrated_args(job: PreparedJob | Any, args: EngineArgs) -> EngineArgs:
    """`args` with quantization_keep (and quantization_scales) set from the job's calibration (read back, or measured
    and written now); `args` itself without a calibration to do. The record goes to `job.calibration` for _SUCCESS;
    `job.calibration_source` says which ("measured" or "read")."""
    cal = getattr(args, "quantization_calibration", None)
    if args.quantization != "int8" or not cal or args.quantization_keep is not None:
        return args
    fingerprint = fingerprint_text(job.fingerprint)
    record = _read(job.out, fingerprint) if job.out is not None else None
    if record is None:
        record = measure_job(job.config, job.inputs, args)
        if job.out is not None and getattr(job, "write_calibration", True):
            job.out.write_text(CALIBRATION, json.dumps({"format": FORMAT, "fingerprint": fingerprint, **record}))
        job.calibration_source = "measured"
    else:
        logger.info("quantization int8: the calibration of an earlier run (%s): kept %s", CALIBRATION,
                    ", ".join(record["keep"]))
        job.calibration_source = "read"
    job.calibration = record
    return dataclasses.replace(args, quantization_keep=tuple(record["keep"]),
                               quantization_scales=record.get("activation_scales") or None)


def measure_job(config, inputs, args: EngineArgs) -> dict[str, Any]:
    """Open an unquantized engine, build the calibration rows with its tokenizer, measure, choose; the record."""
    from batchgen.engine.calibration import (DEFAULT_THRESHOLD, calibration_args, choose_keep, measure,
                                             quantizable_layers)
    from batchgen.engine.engine_args import DEFAULT_CALIBRATION_ACTIVATIONS
    from batchgen.engine.engine import Engine
    from batchgen.models.quantization import DEFAULT_KEEP, is_kept

    cal = args.quantization_calibration
    threshold = float(cal.get("threshold", DEFAULT_THRESHOLD))
    activations = cal.get("activations", DEFAULT_CALIBRATION_ACTIVATIONS)
    alpha = float(cal["alpha"]) if "alpha" in cal else None  # None: searched (engine/calibration.py)
    rows = calibration_rows(inputs.total_rows, int(cal["rows"]))
    started = time.monotonic()
    engine = Engine(calibration_args(args, len(rows)))
    try:
        built = read_rows(config, inputs, engine.tokenizer, engine.max_model_len, rows)
        if not built:
            raise ValueError("engine.quantization_calibration: none of the calibration rows builds into a prompt")
        layers = [name for name in quantizable_layers(engine.model) if not is_kept(name, DEFAULT_KEEP)]
        logger.info("quantization int8: calibrating %d layers on %d rows of the job, %s activations", len(layers),
                    len(built), activations)
        found = measure(engine, [ids for _, ids in built], layers, activations, alpha)
    finally:
        del engine
        gc.collect()
    keep = choose_keep(found.sensitivity, threshold)
    logger.info("quantization int8: kept in the model's dtype: %s (%.1f s)", ", ".join(keep),
                time.monotonic() - started)
    kept = {name for name in found.scales if is_kept(name, tuple(keep))}
    return {"rows": [row for row, _ in built], "threshold": threshold, "keep": keep, "activations": activations,
            **({"alpha": found.alpha} if activations == "smooth" else {}),
            **({"alpha_search": {str(a): round(kl, 8) for a, kl in found.alpha_kl.items()}} if found.alpha_kl else {}),
            "activation_scales": {name: value for name, value in found.scales.items() if name not in kept},
            "sensitivity": {name: round(value, 8) for name, value in found.sensitivity.items()},
            "flips": {name: round(value, 4) for name, value in found.flips.items()},
            "activation_ranges": {name: [round(top, 4), round(mean, 4)] for name, (top, mean) in found.ranges.items()},
            "seconds": round(time.monotonic() - started, 1)}


def job_calibration(job: PreparedJob) -> dict[str, Any] | None:
    """What _SUCCESS says of the job's calibration (None without one): this run's, or an earlier run's read back."""
    record = job.calibration
    if record is None and getattr(job.config.engine, "quantization_calibration", None) and job.out is not None:
        record = _read(job.out, fingerprint_text(job.fingerprint))
    return calibration_summary(record)


def calibration_summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The rows, the layers kept, each layer's sensitivity (mean KL, nats) and the most sensitive layers."""
    if not record:
        return None
    ranked = sorted(record["sensitivity"].items(), key=lambda item: -item[1])
    activations = record.get("activations", "dynamic")
    scales = record.get("activation_scales") or {}
    return {"rows": record["rows"], "threshold": record["threshold"], "keep": record["keep"],
            "activations": activations, **({"alpha": record["alpha"]} if "alpha" in record else {}),
            **({"alpha_search": record["alpha_search"]} if "alpha_search" in record else {}),
            # static: each layer's input scale; smooth: how many layers were smoothed (the factors are in the record)
            **({"static_scales": scales} if activations == "static" else {}),
            **({"smoothed_layers": len(scales)} if activations == "smooth" else {}),
            "sensitivity": record["sensitivity"], "most_sensitive": [name for name, _ in ranked[:5]],
            "activation_ranges": record.get("activation_ranges", {})}


def _read(out, fingerprint: str) -> dict[str, Any] | None:
    text = out.read_text(CALIBRATION)
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("fingerprint") != fingerprint:
        return None
    return record
