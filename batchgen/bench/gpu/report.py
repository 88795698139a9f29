"""The GPU check's phases (each step run on its own, its result or error kept), its verdicts and its closing
table: the greedy checks, the steps that raised, and issue 5's bars."""
from __future__ import annotations

import sys
import time
import traceback


def summary_table(record: dict) -> str:
    device = record["device"]
    lines = [f"GPU check, {device.get('name')}, {record['started'][:10]}: copy "
             f"{device.get('copy_bandwidth_bytes_per_s', 0) / 1e12:.2f} TB/s, bf16 matmul "
             f"{device.get('bf16_matmul_flops_per_s', 0) / 1e12:.0f} TFLOP/s",
             f"{'model':<6} {'greedy bf16/fp32':<17} {'batchgen tok/s':>14} {'HF static tok/s':>15} {'x':>6}  "
             f"decode step ms (x floor) at batch 1 / 32 / 256"]
    for key, m in record["models"].items():
        def verdict(name):
            value = m.get(name)
            if not value:
                return "-"
            return "ERR" if "error" in value else "ok" if value["ok"] else "FAIL"
        ours = m.get("batchgen", {}).get("output_tokens_per_s")
        theirs = m.get("hf_static", {}).get("output_tokens_per_s")
        speedup = f"{ours / theirs:.1f}" if ours and theirs else "-"
        decode = []
        for size in ("1", "32", "256"):
            d = m.get("decode", {}).get(size)
            decode.append(f"{d['median_s'] * 1e3:.2f} ({d['ratio_to_floor']:.2f}x)" if d and "median_s" in d else "-")
        lines.append(f"{key:<6} {verdict('greedy_bf16') + ' / ' + verdict('greedy_fp32'):<17} "
                     f"{f'{ours:,.0f}' if ours else '-':>14} {f'{theirs:,.0f}' if theirs else '-':>15} "
                     f"{speedup:>6}  {' / '.join(decode)}")
    return "\n".join(lines)


def targets(m: dict) -> dict:
    """Issue 5's bars for one model: output tokens/s at least 10x transformers' static batching; decode step time
    within 1.5x of its floor."""
    ours = m.get("batchgen", {}).get("output_tokens_per_s")
    theirs = m.get("hf_static", {}).get("output_tokens_per_s")
    speedup = ours / theirs if ours and theirs else None
    return {"speedup_vs_hf_static": speedup, "speedup_at_least_10x": speedup is not None and speedup >= 10,
            "decode_within_1.5x_of_floor": {size: d["ratio_to_floor"] <= 1.5
                                            for size, d in m.get("decode", {}).items() if "ratio_to_floor" in d}}


def errors(record: dict) -> list[str]:
    """Where a step of the check raised: 'model/step' or 'model/decode/batch size'."""
    found = [f"device/{k}" for k, v in record["device"].items() if isinstance(v, dict) and "error" in v]
    for key, m in record["models"].items():
        found += [f"{key}/{k}" for k, v in m.items() if isinstance(v, dict) and "error" in v]
        found += [f"{key}/decode/{k}" for k, v in m.get("decode", {}).items() if isinstance(v, dict) and "error" in v]
    return found


def passed(record: dict) -> bool:
    """Correctness and completeness (the speed bars are reported, not gated): every greedy check that ran is ok
    and no step raised."""
    greedy_ok = all(m[name].get("ok", False) for m in record["models"].values()
                    for name in ("greedy_bf16", "greedy_fp32") if name in m)
    return greedy_ok and not errors(record)


class Phases:
    """Runs the steps of a check one by one, keeping each one's result or error and its time: one failing step
    must not cost the figures of the others (a GPU session is short)."""

    def __init__(self, record: dict, label: str) -> None:
        self.record, self.label = record, label

    def run(self, key: str, fn, keep: bool = True):
        """fn()'s value (None if it raised); kept in the record under `key` when `keep` (JSON-able values only)."""
        started = time.perf_counter()
        print(f"[{self.label}] {key} ...", file=sys.stderr, flush=True)
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 -- recorded, and the check goes on
            value = None
            self.record[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(f"[{self.label}] {key} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        else:
            if keep:
                self.record[key] = value
        self.record.setdefault("phase_s", {})[key] = time.perf_counter() - started
        return value
