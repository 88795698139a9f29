"""Which dtype and quantization make a job's generation fastest on this kind of CPU, from `batchgen bench
--roofline` records (docs/performance-archive.jsonl) of the same CPU name, core count and instruction sets.

Why the decode batch decides it (the roofline of bench/roofline_floor.py): a decode step reads every weight once
whatever its batch, and does 2 x parameters x batch FLOPs. At small batches the read dominates, so int8 weights
(half of bf16's bytes, a quarter of fp32's) make the step faster; as the batch grows the step becomes bound by
the matmuls' arithmetic, where the int8 kernels (int8 weights widened to the activations' dtype for each multiply;
or, for W8A8, int8 x int8, fast only with VNNI) are no faster than the dtype's own and often slower. Where the
crossover lies depends on the CPU's bandwidth per core and on its instructions (VNNI, native bf16), not on the
model, so it is read from measurements of this CPU kind: the latest roofline record with more than one
(dtype, quantization) measured, any model. Prefill is bound by arithmetic at every size, where a dtype without
native support (bf16 on an AVX2 CPU) can be several times slower: where the record timed a prefill step of each
variant, the job's own prompt and output tokens weigh the two; otherwise decode alone is judged, and said so.
The model's size does change the weight between decode and prefill; the estimate uses the record's step times as
they are, so its seconds are the recorded model's, its ranking this job's."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from batchgen.engine.cpu_features import w8a8_slow_reason

from .throughput import same_cpu

SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
LABELS = {None: "", "int8": " int8 W8A8", "int8-weight-only": " int8 weight-only"}
FASTER = 1.05  # a variant is named faster only past this ratio (the roofline's run-to-run spread is a few %)


def label(variant: tuple[str, str | None]) -> str:
    return SHORT.get(variant[0], variant[0]) + LABELS.get(variant[1], f" {variant[1]}")


def step_times(record: dict[str, Any]) -> dict[tuple[str, str | None], dict[tuple[int, int], float]]:
    """(dtype, quantization) -> (batch, context) -> the best decode step time measured (records before
    --quantization: unquantized)."""
    times: dict[tuple[str, str | None], dict[tuple[int, int], float]] = {}
    for case in record.get("decode", []):
        if "best_s" in case:
            times.setdefault((case["dtype"], case.get("quantization")), {})[(case["batch"], case["context"])] = \
                case["best_s"]
    return times


def speedup(times: dict, base: tuple, other: tuple, batch: int) -> float | None:
    """base's step time over other's at `batch` (> 1: other is faster), the geometric mean over the contexts both
    measured."""
    ratios = [times[base][key] / times[other][key] for key in times[base].keys() & times[other].keys()
              if key[0] == batch]
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


def latest_record(archive: Path, device: dict[str, Any]) -> dict[str, Any] | None:
    """The latest roofline record of this CPU kind that measured decode steps of two or more variants."""
    if not archive.is_file() or device.get("type") != "cpu":
        return None
    best = None
    for line in archive.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") == "roofline" and same_cpu(record.get("machine", {}), device) \
                and len(step_times(record)) >= 2 and (best is None or record["date"] >= best["date"]):
            best = record
    return best


def nearest(batches: set[int], batch: int) -> int:
    return min(batches, key=lambda b: (abs(math.log2(b) - math.log2(max(batch, 1))), b))


def prefill_per_token(record: dict[str, Any]) -> dict[tuple[str, str | None], float]:
    """(dtype, quantization) -> seconds per prompt token of the record's prefill step, where it was measured."""
    return {(case["dtype"], case.get("quantization")): case["best_s"] / case["tokens"]
            for case in record.get("prefill", []) if "best_s" in case and case.get("tokens")}


def w8a8_without_vnni(device: dict[str, Any], quantization: str | None) -> str | None:
    flags = device.get("cpu_flags")
    if quantization != "int8" or device.get("type") != "cpu" or not flags:
        return None
    slow = w8a8_slow_reason({flag for flag, present in flags.items() if present})
    return f"precision: {slow}" if slow else None


def advise_precision(archive: Path, device: dict[str, Any], dtype: str, quantization: str | None,
                     decode_batch: int, prompt_tokens: float, output_tokens: float) -> list[str]:
    from .w8a8_advice import calibrated_w8a8_advice

    no_vnni = w8a8_without_vnni(device, quantization)
    return ([no_vnni] if no_vnni else []) + _measured_advice(archive, device, dtype, quantization, decode_batch,
                                                              prompt_tokens, output_tokens) \
        + calibrated_w8a8_advice(archive, device, quantization)


def _measured_advice(archive: Path, device: dict[str, Any], dtype: str, quantization: str | None,
                     decode_batch: int, prompt_tokens: float, output_tokens: float) -> list[str]:
    """Lines for the plan: each variant's decode step at the job's decode batch (the measured batch nearest it)
    and, where the record timed prefill too, its time per prompt token; the job's generation estimated with each
    (prompt tokens computed x prefill + output tokens x step / batch; decode alone where prefill was not timed);
    the fastest against the job's own; and for each dtype measured with int8-weight-only, the batches where its
    decode step is faster than that dtype's. No record: how to measure, for a job with a quantization."""
    if device.get("type") != "cpu":
        return []
    record = latest_record(archive, device)
    if record is None and quantization is None:
        return []  # nothing measured to advise from, and nothing asked about
    if record is None:
        return [f"precision: no `batchgen bench --roofline` record comparing dtypes or quantizations on this CPU "
                f"kind in {archive}; int8 weights help where decode is bound by reading the weights (small decode "
                f"batches): measure with `batchgen bench --roofline --model MODEL --quantization "
                f"none,int8-weight-only --roofline-batches 1,2,4,8,32`"]
    times, prefill = step_times(record), prefill_per_token(record)
    batch = nearest({b for variant in times.values() for b, _ in variant}, decode_batch)
    at = {variant: [t for (b, _), t in cases.items() if b == batch] for variant, cases in times.items()}
    step = {variant: sum(ts) / len(ts) for variant, ts in at.items() if ts}
    job = (dtype, quantization)
    with_prefill = job in prefill and all(v in prefill for v in step)
    estimate = {v: output_tokens * t / batch + (prompt_tokens * prefill[v] if with_prefill else 0.0)
                for v, t in step.items()}
    ranked = sorted(estimate, key=estimate.get)
    lines = [f"precision: at the job's decode batch (~{decode_batch:,}; batch {batch} measured), on this CPU kind: "
             f"bench --roofline {record['date'][:10]}, model {record.get('model')}",
             "decode step " + ", ".join(f"{label(v)} {step[v] * 1e3:,.1f} ms" for v in ranked)]
    if with_prefill:
        lines.append("prefill " + ", ".join(f"{label(v)} {prefill[v] * 1e3:,.2f} ms" for v in ranked)
                     + " per prompt token")
    what = "the job's generation" if with_prefill else "the job's decode (prefill not timed)"
    lines.append(f"{what}, estimated: " + ", ".join(f"{label(v)} {estimate[v]:,.0f} s" for v in ranked))
    fastest = ranked[0]
    if job not in estimate:
        lines.append(f"the job's {label(job)} was not measured there; fastest: {label(fastest)}")
    elif fastest != job and estimate[job] / estimate[fastest] >= FASTER:
        caveat = "" if with_prefill or fastest[0] == dtype else \
            "; prefill was not timed, and another dtype's can be much slower: time it with --roofline-prefill"
        lines.append(f"faster than the job's {label(job)}: {label(fastest)} ({estimate[job] / estimate[fastest]:.2f}x;"
                     f" dtype and quantization change outputs: README, Performance{caveat})")
    else:
        lines.append(f"the job's {label(job)} is the fastest measured")
    for plain in sorted({v for v in times if v[1] is None}):
        weight_only = (plain[0], "int8-weight-only")
        if weight_only in times:
            ratios = {b: speedup(times, plain, weight_only, b) for b in sorted({b for b, _ in times[weight_only]})}
            ratios = {b: r for b, r in ratios.items() if r is not None}
            faster = [b for b, r in ratios.items() if r >= FASTER]
            lines.append(f"int8-weight-only vs {label(plain)}, decode step: " + ", ".join(
                f"{r:.2f}x at batch {b}" for b, r in ratios.items())
                + (f": faster at batch {', '.join(map(str, faster))}" if faster
                   else ": not faster at any batch measured"))
    return [lines[0]] + [f"  {line}" for line in lines[1:]]
