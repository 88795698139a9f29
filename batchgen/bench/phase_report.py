"""Each phase of a generation run against this machine's roofline (issue 43), beside the peer ratio: per system,
prefill (from the start until the last row has its first token: every row arrives at once) and decode (the rest of
the wall time), each set against its least time on this machine (roofline_floor.py: max(bytes / measured memory
bandwidth, FLOPs / measured matmul rate) per step, summed over the phase's steps) and against the reference
system's (batchgen's) same phase. batchgen also splits its run by its own steps (step_phases.py)."""
from __future__ import annotations

import dataclasses
from typing import Any

from .roofline_floor import ModelCounts, counts_of_description, decode_phase_floor, distinct_prefixes
from .roofline_floor import prefill_phase_floor
from .system_types import SystemRun
from .table import _fmt, render_table
from .workloads import Workload, shared_prefix_length


def model_counts(model: str, dtype: str) -> ModelCounts | None:
    """The model's shape and its unquantized weights in `dtype`, from its description (no weights read); None for a
    checkpoint that holds int8 matrices (a converted GGUF, which the engine keeps in int8): no unquantized run."""
    import torch

    from batchgen.job.plan.memory import inspect_model, stored_int8
    from batchgen.models.loader import resolve_model

    torch_dtype = getattr(torch, dtype)
    description, _ = inspect_model(resolve_model(model), torch_dtype, on_cpu=True)
    return None if stored_int8(description) else counts_of_description(description, torch_dtype)


def ratio(measured: float | None, floor: float) -> float | None:
    return measured / floor if measured is not None and floor > 0 else None


def phase_record(workload: Workload, runs: dict[str, SystemRun], counts: ModelCounts, bandwidth: float,
                 flop_rate: float) -> dict[str, Any]:
    prompt_lens = {row.id: len(row.token_ids) for row in workload.rows}
    prefill = prefill_phase_floor(counts, [row.token_ids for row in workload.rows], bandwidth, flop_rate)
    record: dict[str, Any] = {"bandwidth_bytes_per_s": bandwidth, "matmul_flops": flop_rate,
                              "counts": counts.describe(), "shared_prefix_tokens": shared_prefix_length(workload.rows),
                              "distinct_prompt_tokens": distinct_prefixes([r.token_ids for r in workload.rows])[0],
                              "prefill_floor": dataclasses.asdict(prefill), "systems": {}}
    for name, run in runs.items():
        if not run.available:
            continue
        decode = decode_phase_floor(counts, [prompt_lens[row.id] for row in run.rows],
                                    [len(row.token_ids) for row in run.rows], bandwidth, flop_rate)
        firsts = [row.first_token_s for row in run.rows]
        prefill_s = max(firsts) if firsts and None not in firsts else None
        decode_s = run.wall_s - prefill_s if prefill_s is not None else None
        entry = {"prefill_s": prefill_s, "decode_s": decode_s, "wall_s": run.wall_s,
                 "prefill_floor_s": prefill.floor_s, "decode_floor_s": decode["floor_s"],
                 "wall_floor_s": prefill.floor_s + decode["floor_s"], "decode_floor": decode,
                 "prefill_x": ratio(prefill_s, prefill.floor_s), "decode_x": ratio(decode_s, decode["floor_s"]),
                 "wall_x": ratio(run.wall_s, prefill.floor_s + decode["floor_s"])}
        steps = run.details.get("step_phases")
        if steps:
            entry["steps"] = {**steps, "prefill_x": ratio(steps["prefill_s"], prefill.floor_s),
                              "decode_x": ratio(steps["decode_s"], decode["floor_s"])}
        record["systems"][name] = entry
    return record


def format_phases(record: dict[str, Any]) -> list[str]:
    """The phase table's lines (none when the record has no phases)."""
    phases, reference = record.get("phases"), record.get("reference")
    if not phases or not phases["systems"]:
        return []
    ref = phases["systems"].get(reference, {})

    def peer(entry: dict, key: str) -> str:
        if not ref or entry is ref or entry.get(key) is None or not ref.get(key):
            return "-"
        return _fmt(entry[key] / ref[key], ".2f", "x")

    header = ["system", "prefill s", "floor s", "x roofline", "decode s", "floor s", "x roofline", "wall x roofline",
              f"{reference} x prefill/decode/wall"]
    lines = []
    for name, e in phases["systems"].items():
        lines.append([name, _fmt(e["prefill_s"]), _fmt(e["prefill_floor_s"]), _fmt(e["prefill_x"], ".2f", "x"),
                      _fmt(e["decode_s"]), _fmt(e["decode_floor_s"]), _fmt(e["decode_x"], ".2f", "x"),
                      _fmt(e["wall_x"], ".2f", "x"),
                      "/".join(peer(e, key) for key in ("prefill_s", "decode_s", "wall_s"))])
    floor = phases["prefill_floor"]
    parts = [f"  phases against this machine's roofline (memory {phases['bandwidth_bytes_per_s'] / 1e9:,.1f} GB/s, "
             f"matmul {phases['matmul_flops'] / 1e9:,.1f} GFLOP/s, measured above):", render_table(header, lines)]
    for name, e in phases["systems"].items():
        steps = e.get("steps")
        if steps:
            parts.append(f"  {name} by its own steps: prefill {steps['prefill_s']:.2f} s in {steps['prefill_steps']} "
                         f"steps ({_fmt(steps['prefill_x'], '.2f', 'x')} roofline), decode {steps['decode_s']:.2f} s "
                         f"in {steps['decode_steps']} steps ({_fmt(steps['decode_x'], '.2f', 'x')} roofline)")
    parts.append(f"  prefill = until the last row's first token; decode = the rest of the wall time. roofline = "
                 f"max(bytes / bandwidth, FLOPs / matmul rate) of each step of the unquantized model, summed: prefill "
                 f"{floor['flops'] / 1e12:,.2f} TFLOP ({floor['bound']}-bound; {phases['distinct_prompt_tokens']:,} "
                 f"distinct prompt tokens: each shared prefix once), decode one step per further token, the weights read each step; "
                 f"{reference} x = the system's time over {reference}'s (> 1: {reference} is faster)")
    return parts
