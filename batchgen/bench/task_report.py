"""The record, the printed table, the chart and the `--history` lines of a prefill-only workload (embed, classify,
score): rows/s and tokens/s (the tokens each row runs, after an encoder's cut: the same count for every system),
wall, load, peak memory, and each system's agreement with batchgen (task_agreement.py)."""
from __future__ import annotations

from typing import Any

from .system_types import SystemRun, availability
from .table import _fmt, render_table, short_dtype
from .task_agreement import verdict
from .task_workloads import TextWorkload

REFERENCE = "batchgen"
TASK_HISTORY_HEADER = ["date", "commit", "task", "rows", "system", "dtype", "wall s", "rows/s", "tok/s",
                       "batchgen x", "agrees"]


def task_figures(run: SystemRun, workload: TextWorkload) -> dict[str, Any]:
    figures = availability(run)
    if not run.available:
        return figures
    tokens = workload.prompt_tokens
    figures.update({"startup_s": run.startup_s, "load_s": run.load_s, "wall_s": run.wall_s, "rows": len(run.rows),
                    "prompt_tokens": tokens, "output_tokens": 0, "rows_s": len(run.rows) / run.wall_s,
                    "prompt_tok_s": tokens / run.wall_s, "peak_rss_bytes": run.peak_rss_bytes,
                    "details": run.details})
    return figures


def task_comparisons(task: str, runs: dict[str, SystemRun]) -> dict[str, dict[str, Any]]:
    """For each other system that ran: batchgen's rows/s over its own (> 1: batchgen is faster), the wall ratio, and
    the agreement verdict."""
    ref = runs.get(REFERENCE)
    if ref is None or not ref.available:
        return {}
    ref_rows = {row.id: row for row in ref.rows}
    result = {}
    for name, run in runs.items():
        if name == REFERENCE or not run.available:
            continue
        agreement = verdict(task, ref_rows, {row.id: row for row in run.rows})
        result[name] = {"dtype": run.details.get("dtype"), "reference_dtype": ref.details.get("dtype"),
                        "speedup": (len(ref.rows) / ref.wall_s) / (len(run.rows) / run.wall_s),
                        "wall_ratio": run.wall_s / ref.wall_s, "agreement": agreement}
    return result


def task_row_records(task: str, run: SystemRun) -> list[dict[str, Any]]:
    """Per row what the record keeps: a label and its probabilities, a log-likelihood; not an embedding (the
    agreement's per-row cosine says what a comparison needs)."""
    records = []
    for row in sorted(run.rows, key=lambda row: row.id):
        entry: dict[str, Any] = {"id": row.id}
        if task == "classify":
            entry.update(label=row.label, probs=row.values)
        elif task == "score":
            entry.update(logprob_sum=sum(row.values), scored_tokens=len(row.values))
        else:
            entry["dimensions"] = len(row.values)
        records.append(entry)
    return records


def agreement_text(task: str, agreement: dict[str, Any]) -> str:
    verdict_word = "ok" if agreement["ok"] else "FAILS"
    if task == "embed":
        return f"{verdict_word}: min cos {_fmt(agreement['min_cosine'], '.6f')}"
    if task == "classify":
        return (f"{verdict_word}: max |dp| {_fmt(agreement['max_prob_diff'], '.1e')}, same label "
                f"{_fmt(agreement['same_label_share'], '.0%')}")
    return f"{verdict_word}: max rel {_fmt(agreement['max_rel_diff'], '.1e')}"


def format_task_table(record: dict[str, Any]) -> str:
    task, workload = record["task"], record["workload"]
    header = ["system", "dtype", "start s", "load s", "wall s", "rows/s", "tok/s", "peak RSS", "batchgen x",
              "agreement with batchgen"]
    lines, unavailable = [], []
    for name, f in record["systems"].items():
        if not f["available"]:
            unavailable.append(f"  {name}: unavailable — {f['reason']}")
            continue
        compared = record["comparisons"].get(name)
        size = f["details"].get("batch_size")
        lines.append([f"{name} (B={size})" if size else name, short_dtype(f["dtype"]), _fmt(f.get("startup_s")),
                      _fmt(f["load_s"]), _fmt(f["wall_s"], ",.2f"), _fmt(f["rows_s"]), _fmt(f["prompt_tok_s"], ",.0f"),
                      _fmt((f["peak_rss_bytes"] or 0) / 2**20, ",.0f", " MiB"),
                      _fmt(compared and compared["speedup"], ".2f", "x"),
                      agreement_text(task, compared["agreement"]) if compared else "-"])
    machine = record["machine"]
    mix = ", ".join(f"{count} {kind}" for kind, count in workload["rows_by_length"].items())
    parts = [f"batchgen bench: {task}, {workload['rows']} rows ({mix}), "
             f"{workload['prompt_tokens']:,} tokens run of {workload['text_tokens']:,} "
             f"(max length {workload['max_length'] or '-'}, {workload['rows_truncated']} rows cut); model "
             f"{workload['model']} ({record['date'][:19]}, {machine['cpu']}, {machine['cores']} cores, "
             f"{machine['torch_threads']} torch threads)"]
    if lines:
        parts.append(render_table(header, lines))
    parts += unavailable
    for name, compared in record["comparisons"].items():
        parts.append(f"  {name} agreement rule: {compared['agreement']['rule']}")
    parts.append("  batchgen x = batchgen's rows/s over the system's, on the same rows; tok/s = the rows' tokens "
                 "(after the cut to the model's maximum length) over the wall time")
    return "\n".join(parts)


def write_task_chart(record: dict[str, Any], path) -> None:
    """Bars of rows/s per system that ran, each baseline annotated with batchgen's ratio over it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [(name, f) for name, f in record["systems"].items() if f["available"]]
    figure, axes = plt.subplots(figsize=(max(5.0, 1.8 * len(ran) + 2), 4.5))
    bars = axes.bar([f"{name}\n{short_dtype(f['dtype'])}" for name, f in ran], [f["rows_s"] for _, f in ran],
                    color=["tab:blue" if name == REFERENCE else "tab:gray" for name, _ in ran])
    for bar, (name, _) in zip(bars, ran):
        compared = record["comparisons"].get(name)
        label = f"{bar.get_height():,.1f} rows/s" + (f"\nbatchgen {compared['speedup']:.2f}x" if compared else "")
        axes.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                      fontsize=8, xytext=(0, 2), textcoords="offset points")
    axes.set_ylabel("rows / s (wall time)")
    axes.set_title(f"{record['task']}, {record['workload']['rows']} rows, {record['workload']['model']} — "
                   f"{record['date'][:16]}\n{record['machine']['cpu']} ({record['machine']['cores']} cores)",
                   fontsize=9)
    axes.set_ylim(0, max([f["rows_s"] for _, f in ran] or [1]) * 1.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def task_history_lines(entry: dict[str, Any]) -> list[list[str]]:
    """One line per system of a prefill-only archive entry (TASK_HISTORY_HEADER's columns)."""
    lines = []
    for name, f in entry["systems"].items():
        compared = entry.get("comparisons", {}).get(name, {})
        agreement = compared.get("agreement")
        figures = ([_fmt(f["wall_s"], ",.2f"), _fmt(f["rows_s"]), _fmt(f["prompt_tok_s"], ",.0f"),
                    _fmt(compared.get("speedup"), ".2f", "x"), "-" if agreement is None
                    else "yes" if agreement["ok"] else "no"] if f["available"] else ["unavailable", "-", "-", "-", "-"])
        lines.append([entry["date"][:16], (entry.get("git_commit") or "-")[:8], entry["task"],
                      str(entry["workload"]["rows"]), name, short_dtype(f.get("dtype"))] + figures)
    return lines


def archive_entry(record: dict[str, Any]) -> dict[str, Any]:
    """The record without per-row values, per-row agreement or tracebacks: one line of the archive."""
    entry = {key: value for key, value in record.items() if key not in ("rows", "paths")}
    entry["systems"] = {name: {**f, "details": {k: v for k, v in f.get("details", {}).items() if k != "traceback"}}
                        for name, f in record["systems"].items()}
    entry["comparisons"] = {name: {**c, "agreement": {k: v for k, v in c["agreement"].items() if k != "per_row"}}
                            for name, c in record["comparisons"].items()}
    return entry
