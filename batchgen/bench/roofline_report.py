"""The roofline record as the printed table, and its lines in `batchgen bench --history`."""
from __future__ import annotations

from typing import Any

from .system_types import QUANTIZATION_LABELS
from .table import SHORT_DTYPES as SHORT
from .table import _fmt, render_table


def variant_label(case: dict[str, Any]) -> str:
    """'bf16', 'bf16 int8 weight-only': a case's dtype and quantization (records before --quantization: none)."""
    quantization = QUANTIZATION_LABELS.get(case.get("quantization"), case.get("quantization"))
    return SHORT.get(case["dtype"], case["dtype"]) + (f" {quantization}" if quantization else "")


def format_roofline(record: dict[str, Any]) -> str:
    config, rates, machine = record["config"], record["rates"], record["machine"]
    memory = rates["memory"]
    matmul = ", ".join(f"{SHORT.get(d, d)} {m['flops'] / 1e9:,.1f} GFLOP/s" for d, m in rates["matmul"].items())
    n = next(iter(rates["matmul"].values()))["matmul_n"]
    flags = ", ".join(name for name, present in machine.get("cpu_flags", {}).items() if present) or "-"
    parts = [f"batchgen bench --roofline: {record['model']} ({record['date'][:19]}, {machine['cpu']}, "
             f"{machine['cores']} cores, {machine['torch_threads']} torch threads; flags: {flags})",
             f"  memory read {memory['bytes_per_s'] / 1e9:,.1f} GB/s (sum over {memory['bytes'] / 2**30:,.2f} GiB, "
             f"best of {memory['reps']}); matmul {matmul} ({n}x{n}, best of "
             f"{next(iter(rates['matmul'].values()))['reps']})"]
    header = ["dtype", "batch", "context", "best ms", "median ms", "floor ms", "bound", "x floor", "target",
              "serial ms", "x serial"]
    lines, skipped = [], []
    for case in record["decode"]:
        floor = case["floor"]
        if "skipped" in case:
            skipped.append(f"  {variant_label(case)} decode B={case['batch']} "
                           f"ctx={case['context']}: skipped — {case['skipped']}")
            continue
        lines.append([variant_label(case), str(case["batch"]), str(case["context"]),
                      _fmt(case["best_s"] * 1e3, ",.2f"), _fmt(case["median_s"] * 1e3, ",.2f"),
                      _fmt(floor["floor_s"] * 1e3, ",.2f"), floor["bound"], _fmt(case["ratio"], ".2f", "x"),
                      f"<= {case['target']:.1f}x " + ("ok" if case["ratio"] <= case["target"] else "MISS"),
                      _fmt(floor["serial_s"] * 1e3, ",.2f"), _fmt(case["best_s"] / floor["serial_s"], ".2f", "x")])
    parts.append(f"decode step (forward + LM head + sampling through ModelRunner.execute; best of {config['reps']} "
                 f"after {config['warmup']} warm-up):")
    if lines:
        parts.append(render_table(header, lines))
    parts += skipped
    parts += [f"  {variant_label(v)}: skipped — {v['skipped']}" for v in record.get("skipped_variants", [])]
    parts.append("prefill step (fresh prompts, no cache hits):")
    for case in record["prefill"]:
        name = f"  {variant_label(case)}" + (f" {case['seqs']} x {case['seq_len']} tokens" if case["seqs"] else "")
        if "skipped" in case:
            parts.append(f"{name}: skipped — {case['skipped']}")
            continue
        floor = case["floor"]
        parts.append(f"{name}: {case['best_s'] * 1e3:,.1f} ms (median {case['median_s'] * 1e3:,.1f}), FLOP floor "
                     f"{floor['compute_s'] * 1e3:,.1f} ms ({floor['flops'] / 1e9:,.1f} GFLOP) = "
                     f"{case['share_of_matmul']:.0%} of the matmul rate (target >= {case['target']:.0%}: "
                     + ("ok" if case["share_of_matmul"] >= case["target"] else "MISS") + ")")
    targets = record["targets"]
    parts.append(f"  targets: decode <= {targets['decode_ratio_batch_ge_32']}x floor at batch >= 32, <= "
                 f"{targets['decode_ratio_batch_lt_32']}x below; prefill >= {targets['prefill_share_of_matmul']:.0%}"
                 f" of the matmul rate. floor = max(bytes / bandwidth, FLOPs / matmul rate): weights + KV read, "
                 f"2 x matmul params x batch + attention; serial = the same for the linear layers, plus the same "
                 f"for the attention (the step's phases run one after the other)")
    return "\n".join(parts)


HISTORY_HEADER = ["date", "commit", "model", "dtype", "decode x floor", "at batch >= 32", "prefill"]


def history_lines(entry: dict[str, Any]) -> list[list[str]]:
    """One line per dtype of a roofline archive entry (HISTORY_HEADER's columns): the range of decode step time
    over its floor, over all cases and over those at batch >= 32, and prefill's share of the matmul rate."""
    def span(ratios: list[float]) -> str:
        return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"

    lines = []
    for prefill in entry["prefill"]:
        variant = (prefill["dtype"], prefill.get("quantization"))
        cases = [case for case in entry["decode"]
                 if (case["dtype"], case.get("quantization")) == variant and "ratio" in case]
        lines.append([entry["date"][:16], (entry.get("git_commit") or "-")[:8], str(entry["model"]),
                      variant_label(prefill), span([c["ratio"] for c in cases]),
                      span([c["ratio"] for c in cases if c["batch"] >= 32]),
                      _fmt(prefill.get("share_of_matmul"), ".0%")])
    return lines
