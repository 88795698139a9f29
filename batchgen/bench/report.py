"""Figures from the systems' runs, the comparison with batchgen, and their outputs: the printed table, the JSON
record, the PNG chart, the archive line and the `--history` table."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from .phase_report import format_phases
from .roofline_report import HISTORY_HEADER, history_lines
from .system_types import SystemRun, availability
from .table import _fmt, render_table, short_dtype
from .workloads import Workload

REFERENCES = ("batchgen", "batchgen-nocache")  # what the ratios are of: the first of these that ran


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p90/p99 with linear interpolation between order statistics; None for no values."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None

    def at(q: float) -> float:
        position = q * (len(values) - 1)
        low, high = math.floor(position), math.ceil(position)
        return values[low] + (values[high] - values[low]) * (position - low)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


def system_figures(run: SystemRun, workload: Workload) -> dict[str, Any]:
    figures = availability(run)
    if not run.available:
        return figures
    prompt_tokens = workload.prompt_tokens
    output_tokens = sum(len(row.token_ids) for row in run.rows)
    cache_hit = run.details.get("prefix_cache_hit_rate")
    figures.update({
        "startup_s": run.startup_s, "load_s": run.load_s, "wall_s": run.wall_s, "rows": len(run.rows),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "prompt_tok_s": prompt_tokens / run.wall_s, "output_tok_s": output_tokens / run.wall_s,
        "ttft_s": percentiles([row.ttft_s for row in run.rows]),
        "tpot_s": percentiles([row.tpot_s for row in run.rows]),
        "peak_rss_bytes": run.peak_rss_bytes, "prefix_cache_hit_rate": cache_hit,
        "details": {k: v for k, v in run.details.items() if k != "prefix_cache_hit_rate"},
    })
    return figures


def reference_of(runs: dict[str, SystemRun]) -> str | None:
    return next((name for name in REFERENCES if name in runs and runs[name].available), None)


def comparisons(runs: dict[str, SystemRun], decode: Callable[[list[int]], str] | None = None
                ) -> dict[str, dict[str, Any]]:
    """For each other system that ran: batchgen's output tok/s over its own (the speed ratio, > 1 = batchgen is
    faster), the wall-time ratio on the same rows, and the share of rows whose greedy token ids equal batchgen's;
    with the dtype each side ran in."""
    reference = reference_of(runs)
    if reference is None:
        return {}
    ref = runs[reference]
    ref_tokens = {row.id: row.token_ids for row in ref.rows}
    ref_speed = sum(len(t) for t in ref_tokens.values()) / ref.wall_s
    result = {}
    for name, run in runs.items():
        if name == reference or not run.available:
            continue
        speed = sum(len(row.token_ids) for row in run.rows) / run.wall_s
        identical = sum(1 for row in run.rows if ref_tokens.get(row.id) == row.token_ids)
        total = max(len(ref_tokens), len(run.rows))
        result[name] = {"dtype": run.details.get("dtype"), "reference_dtype": ref.details.get("dtype"),
                        "quantization": run.details.get("quantization"),
                        "reference_quantization": ref.details.get("quantization"),
                        "speedup": ref_speed / speed if speed else None, "wall_ratio": run.wall_s / ref.wall_s,
                        "identical_rows": identical, "rows": total,
                        "identical_share": identical / total if total else None}
        if "label_token_ids" in run.details and decode is not None:
            result[name].update(label_agreement(run, ref_tokens, decode))
    return result


def label_agreement(run: SystemRun, ref_tokens: dict[int, list[int]], decode: Callable[[list[int]], str]
                    ) -> dict[str, Any]:
    """For a system answering with labels (batchgen-choice), against the reference's free greedy answers: the share
    of those that are exactly a label's tokens then EOS; the share that read as a label once lowercased and
    stripped of spaces and punctuation ("Positive." is positive); and on the latter, the share where both chose the
    same label."""
    labels = {tuple(ids): label for label, ids in run.details["label_token_ids"].items()}
    mine = {row.id: labels.get(tuple(row.token_ids)) for row in run.rows}
    exact = sum(1 for ids in ref_tokens.values() if tuple(ids) in labels)
    read = {row_id: decode(ids).strip().strip(".!:;,\"'").lower() for row_id, ids in ref_tokens.items()}
    valid = [row_id for row_id, text in read.items() if text in labels.values()]
    same = sum(1 for row_id in valid if mine.get(row_id) == read[row_id])
    total = len(ref_tokens)
    return {"reference_exact_label": exact / total if total else None,
            "reference_answers_a_label": len(valid) / total if total else None,
            "label_agreement": same / len(valid) if valid else None}


def row_records(run: SystemRun) -> list[dict[str, Any]]:
    return [{"id": row.id, "output_tokens": len(row.token_ids), "ttft_s": row.ttft_s, "tpot_s": row.tpot_s,
             "cached_tokens": row.cached_tokens, "token_ids": row.token_ids}
            for row in sorted(run.rows, key=lambda row: row.id)]


# -- writing -----------------------------------------------------------------------------------------------------

def archive_entry(record: dict[str, Any]) -> dict[str, Any]:
    """The record without per-row outputs or tracebacks: one line of the performance archive."""
    entry = {key: value for key, value in record.items() if key not in ("rows", "paths")}
    if "systems" not in record:  # a roofline record: no per-system figures
        return entry
    entry["systems"] = {}
    for name, figures in record["systems"].items():
        details = {k: v for k, v in figures.get("details", {}).items() if k != "traceback"}
        entry["systems"][name] = {**figures, "details": details}
    return entry


def append_archive(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(archive_entry(record)) + "\n")


def write_record(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def write_chart(record: dict[str, Any], path: Path) -> None:
    """Bars of output tok/s per system that ran, each baseline annotated with batchgen's speed ratio over it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [(name, f) for name, f in record["systems"].items() if f["available"]]
    names = [f"{label_of(name, f)}\n{precision(f)}" for name, f in ran]
    speeds = [f["output_tok_s"] for _, f in ran]
    figure, axes = plt.subplots(figsize=(max(5.0, 1.6 * len(ran) + 2), 4.5))
    colors = ["tab:blue" if name.startswith("batchgen") else "tab:gray" for name in names]
    bars = axes.bar(names, speeds, color=colors)
    for bar, (name, _) in zip(bars, ran):
        compared = record["comparisons"].get(name)
        label = f"{bar.get_height():,.1f} tok/s"
        if compared and compared["speedup"] is not None:
            label += f"\n{record['reference']} {compared['speedup']:.2f}x"
        axes.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                      fontsize=8, xytext=(0, 2), textcoords="offset points")
    workload = record["workload"]
    axes.set_ylabel("output tokens / s (generation wall time)")
    axes.set_title(f"{workload['name']}, {workload['rows']} rows, greedy — {record['date'][:16]}\n"
                   f"{record['machine']['cpu']} ({record['machine']['cores']} cores)", fontsize=9)
    axes.set_ylim(0, max(speeds or [1]) * 1.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -- tables ------------------------------------------------------------------------------------------------------

def label_of(name: str, figures: dict) -> str:
    """The system's name, with hf-static's winning batch size."""
    size = figures.get("details", {}).get("batch_size")
    return f"{name} (B={size})" if size is not None else name


def precision(figures: dict) -> str:
    """The dtype and the quantization a system ran in: 'bf16', 'bf16 int8 W8A8'."""
    quantization = figures.get("quantization")
    return short_dtype(figures.get("dtype")) + (f" {quantization}" if quantization else "")


def _pcts(p: dict | None, scale: float = 1000.0) -> str:
    return "-" if p is None else "/".join(f"{p[k] * scale:,.0f}" for k in ("p50", "p90", "p99"))


def format_table(record: dict[str, Any]) -> str:
    """The compact summary printed at the end of a run."""
    reference = record["reference"] or "batchgen"
    header = ["system", "dtype", "start s", "load s", "wall s", "prompt tok/s", "out tok/s", "TTFT ms p50/90/99",
              "TPOT ms p50/90/99", "peak RSS", "cache hit", f"{reference} x", "same as ref"]
    lines, unavailable = [], []
    for name, f in record["systems"].items():
        if not f["available"]:
            unavailable.append(f"  {name}: unavailable — {f['reason']}")
            continue
        compared = record["comparisons"].get(name, {})
        lines.append([label_of(name, f), precision(f), _fmt(f.get("startup_s")), _fmt(f["load_s"]),
                      _fmt(f["wall_s"]),
                      _fmt(f["prompt_tok_s"]),
                      _fmt(f["output_tok_s"]), _pcts(f["ttft_s"]), _pcts(f["tpot_s"]),
                      _fmt(f["peak_rss_bytes"] / 2**20, ",.0f", " MiB"), _fmt(f["prefix_cache_hit_rate"], ".0%"),
                      _fmt(compared.get("speedup"), ".2f", "x"), _fmt(compared.get("identical_share"), ".0%")])
    workload, config = record["workload"], record["config"]
    length = (f"exactly {config['max_tokens']} tokens a row (ignore_eos)" if config.get("ignore_eos")
              and config.get("max_tokens") else "ignore_eos" if config.get("ignore_eos")
              else f"max_tokens {config['max_tokens']} a row" if config.get("max_tokens") else "EOS or max_tokens")
    parts = [f"batchgen bench: {workload['name']}, {workload['rows']} rows, {workload['prompt_tokens']:,} prompt "
             f"tokens, greedy, {length}; model {workload['model']} ({record['date'][:19]}, "
             f"{record['machine']['cpu']}, {record['machine']['cores']} cores, {record['machine']['torch_threads']} "
             f"torch threads)"]
    if lines:
        parts.append(render_table(header, lines))
    parts += unavailable
    ceiling = record["ceiling"]
    parts.append(f"  machine ceiling: {ceiling['flops'] / 1e9:,.1f} GFLOP/s "
                 f"({short_dtype(ceiling.get('dtype', 'float32'))} {ceiling['matmul_n']}x"
                 f"{ceiling['matmul_n']} matmul, best of {ceiling['reps']}"
                 + (f", {ceiling['kernel']}" if "kernel" in ceiling else "") + ")")
    parts += format_phases(record)
    decode = record.get("decode")
    if decode:
        parts.append(f"  {reference} during decode: {decode['decode_flops'] / 1e9:,.2f} GFLOP/s = "
                     f"{decode['share_of_ceiling']:.1%} of the ceiling ({decode['note']})")
    for name, compared in record["comparisons"].items():
        if compared.get("label_agreement", "absent") != "absent":
            f = record["systems"][name]
            parts.append(f"  {name}: wall {f['wall_s']:.2f} s = {compared['wall_ratio']:.2f}x {reference}'s "
                         f"unconstrained greedy labels; {reference}'s answer is exactly a label on "
                         f"{_fmt(compared['reference_exact_label'], '.0%')} of rows, reads as one on "
                         f"{_fmt(compared['reference_answers_a_label'], '.0%')}, and there the labels agree on "
                         f"{_fmt(compared['label_agreement'], '.0%')}; mean confidence "
                         f"{f['details'].get('mean_confidence', 0):.2f}")
    ref_dtype = precision(record["systems"].get(reference, {}))
    parts.append(f"  {reference} x = {reference}'s output tok/s ({ref_dtype}) over the system's (in its own dtype), "
                 f"on the same rows; same as ref = rows whose greedy token ids equal {reference}'s")
    if any(f.get("startup_s") is not None for f in record["systems"].values()):
        parts.append("  start s = a fresh process, from its spawn to ready for requests (imports, tokenizer, weights, "
                     "int8 or packing, KV cache; batchgen: batchgen/bench/startup_probe.py, vLLM: its worker until "
                     "LLM() returns); load s = the engine's construction in the bench's process (vLLM: the worker's "
                     "imports + LLM())")
    return "\n".join(parts)


def history_table(path: Path) -> str:
    """The archive as a table: one line per system per run; roofline runs (`bench --roofline`) in a second one."""
    if not path.is_file():
        return f"no archive at {path} (a bench run appends to it)"
    from .task_report import TASK_HISTORY_HEADER, task_history_lines

    lines, roofline, tasks = [], [], []
    for text in path.read_text().splitlines():
        if not text.strip():
            continue
        entry = json.loads(text)
        if entry.get("kind") == "roofline":
            roofline += history_lines(entry)
            continue
        if entry.get("task") not in (None, "generate"):  # embed, classify, score: rows/s, not output tokens
            tasks += task_history_lines(entry)
            continue
        commit = (entry.get("git_commit") or "-")[:8]
        for name, f in entry.get("systems", {}).items():  # a kv-int8 record (dev/bench_kv_int8.py) has none
            compared = entry.get("comparisons", {}).get(name, {})
            if f["available"]:
                figures = [_fmt(f["wall_s"]), _fmt(f["output_tok_s"]), _fmt(f.get("prefix_cache_hit_rate"), ".0%"),
                           _fmt(compared.get("speedup"), ".2f", "x"), _fmt(compared.get("identical_share"), ".0%")]
            else:
                figures = ["unavailable", "-", "-", "-", "-"]
            dtype = precision({**f, "dtype": f.get("dtype") or "float32"})  # before --dtype: every system ran fp32
            lines.append([entry["date"][:16], commit, entry["workload"]["name"], str(entry["workload"]["rows"]),
                          name, dtype] + figures)
    if not lines and not roofline and not tasks:
        return f"the archive {path} is empty"
    header = ["date", "commit", "workload", "rows", "system", "dtype", "wall s", "out tok/s", "cache hit",
              "batchgen x", "same"]
    tables = [render_table(header, lines)] if lines else []
    if roofline:
        tables.append("roofline (bench --roofline): decode step time / floor, prefill share of the matmul rate\n"
                      + render_table(HISTORY_HEADER, roofline))
    if tasks:
        tables.append("embed, classify, score (prefill only): rows/s\n" + render_table(TASK_HISTORY_HEADER, tasks))
    return "\n\n".join(tables)
