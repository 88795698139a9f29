"""`engine.quantization_calibration: {rows: N}` with `quantization: int8`: which layers the run keeps in the model's
dtype, measured on N of the job's own rows (engine/calibration.py) before the quantized engine loads.

The rows are evenly spaced over the input (row i * total // N, i < N: the same rows on every run of the job) and
built as the run builds them. The measurement is written beside the output (`_calibration.json`, marked
batchgen-calibration/1, with the job's fingerprint) before any row runs: a resumed run reads it back and keeps the
same layers, whatever a new measurement would say (timing noise does not enter it, but thread counts can move a
layer across the threshold). `_SUCCESS` gets the rows, the layers kept and the sensitivities (calibration_summary)."""
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
    """`args` with quantization_keep set from the job's calibration (read back, or measured and written now); `args`
    itself without a calibration to do. The record goes to `job.calibration` for _SUCCESS."""
    cal = getattr(args, "quantization_calibration", None)
    if args.quantization != "int8" or not cal or args.quantization_keep is not None:
        return args
    fingerprint = fingerprint_text(job.fingerprint)
    record = _read(job.out, fingerprint) if job.out is not None else None
    if record is None:
        record = measure_job(job.config, job.inputs, args)
        if job.out is not None:
            job.out.write_text(CALIBRATION, json.dumps({"format": FORMAT, "fingerprint": fingerprint, **record}))
    else:
        logger.info("quantization int8: the calibration of an earlier run (%s): kept %s", CALIBRATION,
                    ", ".join(record["keep"]))
    job.calibration = record
    return dataclasses.replace(args, quantization_keep=tuple(record["keep"]))


def measure_job(config, inputs, args: EngineArgs) -> dict[str, Any]:
    """Open an unquantized engine, build the calibration rows with its tokenizer, measure, choose; the record."""
    from batchgen.engine.calibration import (DEFAULT_THRESHOLD, calibration_args, choose_keep, measure,
                                             quantizable_layers)
    from batchgen.engine.engine import Engine
    from batchgen.models.quantization import DEFAULT_KEEP, is_kept

    cal = args.quantization_calibration
    threshold = float(cal.get("threshold", DEFAULT_THRESHOLD))
    rows = calibration_rows(inputs.total_rows, int(cal["rows"]))
    started = time.monotonic()
    engine = Engine(calibration_args(args, len(rows)))
    try:
        built = read_rows(config, inputs, engine.tokenizer, engine.max_model_len, rows)
        if not built:
            raise ValueError("engine.quantization_calibration: none of the calibration rows builds into a prompt")
        layers = [name for name in quantizable_layers(engine.model) if not is_kept(name, DEFAULT_KEEP)]
        logger.info("quantization int8: calibrating %d layers on %d rows of the job", len(layers), len(built))
        found = measure(engine, [ids for _, ids in built], layers)
    finally:
        del engine
        gc.collect()
    keep = choose_keep(found.sensitivity, threshold)
    logger.info("quantization int8: kept in the model's dtype: %s (%.1f s)", ", ".join(keep),
                time.monotonic() - started)
    return {"rows": [row for row, _ in built], "threshold": threshold, "keep": keep,
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
    return {"rows": record["rows"], "threshold": record["threshold"], "keep": record["keep"],
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
