"""The job report as one HTML page: the health report (latency distributions with p50/p90/p99, throughput, batch
size, KV use, preemptions, prefix-cache hits and memory over the run, error rows by reason, tokens per dollar) of one
output, or of several side by side (each chart draws every output; the table gives each figure's ratio to the
first's). Everything is inline: the page needs no script and no network."""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from html import escape
from typing import Callable

import batchgen

from ..output.parts import REPORT, SIDE_FILE_MARKS
from .rows import LATENCIES, ReportRows
from .svg import Axis, Marker, Series, bar_chart, line_chart

GENERATOR = SIDE_FILE_MARKS[REPORT]  # <meta name="generator" content="batchgen">: makes a _report.html batchgen's
LATENCY_TITLES = {"ttft_s": "Time to first token", "tpot_s": "Time per output token", "queue_s": "Queue time",
                  "e2e_s": "End to end"}
# the charts, in page order (the Chromium test checks each is drawn)
CHARTS = ("ttft", "tpot", "queue", "by_length", "progress", "throughput", "batch", "kv", "preemptions", "prefix",
          "memory", "errors")


@dataclass
class ReportData:
    """One output's report inputs."""

    label: str  # the output's path
    summary: dict  # its _SUCCESS
    timeline: dict | None  # its _timeline.json (None for an output written before timelines)
    rows: ReportRows


def render(outputs: list[ReportData]) -> str:
    names = short_names([o.label for o in outputs])
    compare = len(outputs) > 1
    title = "batchgen job report" if not compare else f"batchgen report: {len(outputs)} outputs side by side"
    sections = [f"<h1>{escape(title)}</h1>", _header(outputs, names), _health_table(outputs, names),
                '<div class="charts">', *_latency_charts(outputs, names), *_timeline_charts(outputs, names),
                _errors_chart(outputs, names), "</div>", _runs_table(outputs, names), _replicas_table(outputs, names),
                _footer(outputs)]
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">{GENERATOR}"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n")


def short_names(labels: list[str]) -> list[str]:
    """The outputs' last path components, or their full paths where those repeat."""
    tails = [label.rstrip("/").rsplit("/", 1)[-1] or label for label in labels]
    return tails if len(set(tails)) == len(tails) else labels


# -- numbers ---------------------------------------------------------------------------------------------------------

def seconds(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s" if value < 600 else f"{value / 60:.1f} min"


def size(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def count(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:.3g}"


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


# -- sections --------------------------------------------------------------------------------------------------------

def _header(outputs: list[ReportData], names: list[str]) -> str:
    items = []
    for name, o in zip(names, outputs):
        s, machine = o.summary, o.summary.get("machine") or {}
        flags = ", ".join(flag for flag, present in (machine.get("cpu_flags") or {}).items() if present)
        items.append(f"<li><b>{escape(name)}</b>: <code>{escape(o.label)}</code> · model "
                     f"<code>{escape(str(s.get('model', '?')))}</code> · {escape(str(s.get('dtype', '?')))} · "
                     f"finished {escape(str(s.get('finished_at', '?'))[:19])} · "
                     f"{escape(str(machine.get('cpu', 'machine not recorded')))}"
                     + (f" ({machine.get('cores')} cores; {escape(flags)})" if machine else "") + "</li>")
    return f"<ul class=\"outputs\">{''.join(items)}</ul>"


def _health(o: ReportData) -> list[tuple[str, float | None, Callable, bool]]:
    """(figure, value, format, higher is better) of one output."""
    s, rows = o.summary, o.rows.to_json()
    engine_s = s.get("wall_s") or 0
    figures = [("rows", s.get("rows"), count, True), ("error rows", s.get("rows_error"), count, False),
               ("wall time (this run)", engine_s, seconds, False),
               ("output tokens/s", s.get("output_tokens_per_s"), count, True),
               ("rows/s", s.get("rows_this_run", 0) / engine_s if engine_s else None, count, True)]
    for name in LATENCIES:
        for q in (50, 90, 99):
            figures.append((f"{LATENCY_TITLES[name].lower()} p{q}", (rows[name] or {}).get(f"p{q}"), seconds, False))
    figures += [("prefix-cache hit rate", s.get("prefix_cache_hit_rate"), percent, True),
                ("preemptions", s.get("preemptions"), count, False),
                ("peak memory", s.get("peak_memory_bytes"), size, False),
                ("memory bound", s.get("memory_bound_bytes"), size, False),
                ("cost per hour (USD)", s.get("cost_per_hour"), lambda v: f"{v:g}", False),
                ("output tokens per dollar", s.get("tokens_per_dollar"), count, True)]
    return figures


def _health_table(outputs: list[ReportData], names: list[str]) -> str:
    """Two tables side by side: the run's figures, and its latencies."""
    tables = [_health(o) for o in outputs]
    head = "".join(f"<th>{escape(n)}</th>" + (f"<th>vs {escape(names[0])}</th>" if i else "")
                   for i, n in enumerate(names))
    body: dict[bool, list[str]] = {False: [], True: []}
    for r, (figure, *_rest) in enumerate(tables[0]):
        cells = []
        base = tables[0][r][1]
        for i, table in enumerate(tables):
            _, value, fmt, higher = table[r]
            cells.append(f"<td>{escape(fmt(value)) if value is not None else '–'}</td>")
            if i:
                cells.append(_ratio_cell(value, base, higher))
        latency = figure.rsplit(" ", 1)[-1] in ("p50", "p90", "p99")
        body[latency].append(f"<tr><th>{escape(figure)}</th>{''.join(cells)}</tr>")
    note = "" if outputs[0].summary.get("cost_per_hour") else \
        '<p class="note">Tokens per dollar: give the machine\'s price with <code>batchgen run --cost-per-hour</code>.</p>'
    tables_html = "".join(f"<table class=\"health\"><tr><th></th>{head}</tr>{''.join(rows)}</table>"
                          for rows in (body[False], body[True]))
    return f"<h2>Health</h2><div class=\"tables\">{tables_html}</div>{note}"


def _ratio_cell(value: float | None, base: float | None, higher: bool) -> str:
    if value is None or not base:
        return "<td>–</td>"
    ratio = value / base
    better = ratio > 1.0 if higher else ratio < 1.0
    kind = "same" if abs(ratio - 1) < 0.02 else "better" if better else "worse"
    return f'<td class="{kind}">{ratio:.2f}x</td>'


def _latency_charts(outputs: list[ReportData], names: list[str]) -> list[str]:
    charts = []
    for chart_id, name in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("queue", "queue_s")):
        series, markers = [], []
        for label, o in zip(names, outputs):
            groups = [(label if len(outputs) > 1 else "all rows", None)]
            replicas = o.rows.replicas()
            if len(outputs) == 1 and len(replicas) > 1:
                groups += [(f"replica {r}", r) for r in replicas]
            for series_label, replica in groups:
                values = o.rows.values(name, replica)
                if values.size:
                    series.append(_cdf(series_label, values))
        if len(outputs) == 1:
            stats = outputs[0].rows.to_json()[name] or {}
            markers = [Marker(f"p{q} {seconds(stats[f'p{q}'])}", x=stats[f"p{q}"]) for q in (50, 90, 99)
                       if stats.get(f"p{q}")]
        sampled = outputs[0].rows
        note = f"From a uniform sample of {sampled.sampled:,} of {sampled.rows:,} rows." \
            if sampled.sampled < sampled.rows else ""
        charts.append(line_chart(chart_id, f"{LATENCY_TITLES[name]}: share of rows within", series,
                                 Axis("seconds", log=True, fmt=_log_label), Axis("rows", fmt=lambda v: f"{v:.0%}",
                                                                                 low=0, high=1),
                                 markers, note))
    return charts + [_by_length_chart(outputs, names)]


def _by_length_chart(outputs: list[ReportData], names: list[str]) -> str:
    """For whom: the median TTFT (solid) and end-to-end time (dashed) of rows by their prompt's length."""
    series = []
    for label, o in zip(names, outputs):
        for name, dashed in (("ttft_s", False), ("e2e_s", True)):
            points = o.rows.by_bins(name)
            if points:
                what = "TTFT" if name == "ttft_s" else "end to end"
                series.append(Series(f"{label} · {what}" if len(outputs) > 1 else what, [p[0] for p in points],
                                     [p[1] for p in points], dashed=dashed))
    return line_chart("by_length", "By prompt length: median TTFT and end-to-end time", series,
                      Axis("prompt tokens (median of each power-of-two bin)", log=True, fmt=count),
                      Axis("seconds", log=True, fmt=_log_label),
                      note="Bins of fewer than 3 rows are left out.")


def _cdf(label: str, values) -> Series:
    import numpy as np

    ordered = np.sort(values)
    step = max(1, ordered.size // 400)
    xs = ordered[::step].tolist() + [float(ordered[-1])]
    ys = [(i * step + 1) / ordered.size for i in range(len(xs) - 1)] + [1.0]
    return Series(label, xs, ys)


def _log_label(value: float) -> str:
    return seconds(value) if value >= 1e-3 else f"{value * 1e6:.0f} µs"


# -- over time -------------------------------------------------------------------------------------------------------

Segment = dict  # one run's columns of one lane, "t" shifted to seconds since the output's first run


def lane_segments(timeline: dict | None) -> dict[str, list[Segment]]:
    lanes: dict[str, list[Segment]] = {}
    runs = (timeline or {}).get("runs") or []
    if not runs:
        return lanes
    first = runs[0].get("started_unix", 0)
    for run in runs:
        offset = run.get("started_unix", first) - first
        for name, lane in (run.get("lanes") or {}).items():
            columns = dict(lane.get("columns") or {})
            if columns.get("t"):
                columns["t"] = [t + offset for t in columns["t"]]
                columns["_constants"] = lane.get("constants") or {}
                lanes.setdefault(name, []).append(columns)
    return lanes


def _level(segments: list[Segment], field: str, scale: Callable[[float, Segment], float | None]) -> tuple[list, list]:
    xs, ys = [], []
    for seg in segments:
        for t, value in zip(seg["t"], seg.get(field) or []):
            xs.append(t)
            ys.append(scale(value, seg) if value is not None else None)
        xs.append(xs[-1] if xs else 0)
        ys.append(None)  # a gap between runs
    return xs, ys


def _ratio(segments: list[Segment], numerator: str, denominator: str) -> tuple[list, list]:
    """One running sum over another, at each sample (None before the second grows)."""
    xs, ys = [], []
    for seg in segments:
        for t, top, bottom in zip(seg["t"], seg.get(numerator) or [], seg.get(denominator) or []):
            xs.append(t)
            ys.append(top / bottom if top is not None and bottom else None)
        xs.append(xs[-1] if xs else 0)
        ys.append(None)
    return xs, ys


def _rate(segments: list[Segment], field: str, per: str | None = None, factor: float = 1.0) -> tuple[list, list]:
    """The growth of a running sum per second (or per the growth of `per`), between successive samples."""
    xs, ys = [], []
    for seg in segments:
        ts, values = seg["t"], seg.get(field) or []
        base = seg.get(per) or [] if per else ts
        for i in range(1, min(len(ts), len(values), len(base))):
            if None in (values[i], values[i - 1], base[i], base[i - 1]):
                continue
            span = base[i] - base[i - 1]
            xs.append(ts[i])
            ys.append(factor * (values[i] - values[i - 1]) / span if span > 0 else None)
        xs.append(ts[-1])
        ys.append(None)
    return xs, ys


def _timeline_charts(outputs: list[ReportData], names: list[str]) -> list[str]:
    compare = len(outputs) > 1
    lanes = [(label, lane_segments(o.timeline)) for label, o in zip(names, outputs)]

    def series(pick: Callable[[list[Segment]], tuple[list, list]], engine: bool = True) -> list[Series]:
        out = []
        for label, by_lane in lanes:
            for lane, segments in by_lane.items():
                if (lane == "job") == engine:
                    continue
                xs, ys = pick(segments)
                out.append(Series(f"{label} · {lane}" if compare else lane, xs, ys))
        return out

    t_axis = Axis("seconds since the first run started", fmt=lambda v: f"{v:g}")
    kv_share = lambda value, seg: value / seg["_constants"]["kv_pool_blocks"] \
        if seg["_constants"].get("kv_pool_blocks") else None
    memory_markers = []
    if not compare:
        s = outputs[0].summary
        if s.get("memory_bound_bytes"):
            memory_markers.append(Marker(f"bound {size(s['memory_bound_bytes'])}", y=s["memory_bound_bytes"] / 2**30,
                                         color="#dc2626"))
        if s.get("peak_memory_bytes"):
            memory_markers.append(Marker(f"peak {size(s['peak_memory_bytes'])}", y=s["peak_memory_bytes"] / 2**30))
    note = "" if any(by_lane for _, by_lane in lanes) else \
        "This output has no timeline (_timeline.json): it was written by a batchgen before timelines."
    return [
        line_chart("progress", "Rows done (earlier runs' included)", series(lambda seg: _level(seg, "rows_done", lambda v, s: v),
                                                        engine=False), t_axis, Axis("rows", fmt=count), note=note),
        line_chart("throughput", "Output tokens per second",
                   series(lambda seg: _rate(seg, "output_tokens")), t_axis, Axis("tokens/s", fmt=count)),
        line_chart("batch", "Batch size (sequences per step, mean over each interval)",
                   series(lambda seg: _rate(seg, "step_seqs", per="steps")), t_axis, Axis("sequences", fmt=count)),
        line_chart("kv", "KV cache in use", series(lambda seg: _level(seg, "kv_blocks_in_use", kv_share)), t_axis,
                   Axis("of the pool", fmt=lambda v: f"{v:.0%}", low=0, high=1)),
        line_chart("preemptions", "Preemptions (running total)",
                   series(lambda seg: _level(seg, "preemptions", lambda v, s: v)), t_axis, Axis("preemptions",
                                                                                               fmt=count)),
        line_chart("prefix", "Prefix-cache hit rate so far (share of the prompt tokens looked up)",
                   series(lambda seg: _ratio(seg, "prefix_hits", "prefix_queries")), t_axis,
                   Axis("hit", fmt=lambda v: f"{v:.0%}", low=0, high=1)),
        line_chart("memory", "Resident memory", series(lambda seg: _level(seg, "rss_bytes", lambda v, s: v / 2**30)),
                   t_axis, Axis("GiB", fmt=lambda v: f"{v:g}"), memory_markers),
    ]


def _errors_chart(outputs: list[ReportData], names: list[str]) -> str:
    bars = []
    for label, o in zip(names, outputs):
        for reason, number in o.rows.error_reasons.most_common(12):
            bars.append((f"{label}: {reason}" if len(outputs) > 1 else reason, number))
    return bar_chart("errors", "Error rows by reason (numbers masked as N)", bars, fmt=count,
                     empty_text="no error rows")


def _runs_table(outputs: list[ReportData], names: list[str]) -> str:
    rows = []
    for label, o in zip(names, outputs):
        for run in (o.timeline or {}).get("runs") or []:
            job = ((run.get("lanes") or {}).get("job") or {}).get("columns") or {}
            done = (job.get("rows_done") or [None])[-1]
            rows.append(f"<tr><td>{escape(label)}</td><td>{escape(str(run.get('started_at', ''))[:19])}</td>"
                        f"<td>{escape(str(run.get('status')))}</td><td>{seconds(run.get('duration_s'))}</td>"
                        f"<td>{count(run.get('rows_at_start'))}</td><td>{count(done)}</td></tr>")
    if not rows:
        return ""
    return ("<h2>Runs</h2><p class=\"note\">Each run of the job on this output; <i>running</i> marks one that "
            "stopped without a word (killed).</p><table><tr><th>output</th><th>started (UTC)</th><th>ended</th>"
            "<th>duration</th><th>rows done at start</th><th>at its last sample</th></tr>" + "".join(rows)
            + "</table>")


def _replicas_table(outputs: list[ReportData], names: list[str]) -> str:
    rows = []
    for label, o in zip(names, outputs):
        for index, replica in sorted((o.summary.get("replicas") or {}).items(), key=lambda item: int(item[0])):
            stats, wall = replica.get("engine_stats") or {}, replica.get("wall_s") or 0
            rows.append(f"<tr><td>{escape(label)}</td><td>{escape(index)}</td><td>{count(replica.get('rows'))}</td>"
                        f"<td>{count(replica.get('output_tokens'))}</td><td>{seconds(wall)}</td>"
                        f"<td>{count(replica.get('output_tokens', 0) / wall) if wall else '–'}</td>"
                        f"<td>{size(stats.get('peak_memory_bytes'))}</td><td>{count(stats.get('num_preemptions'))}"
                        f"</td></tr>")
    if not rows:
        return ""
    return ("<h2>Replicas</h2><table><tr><th>output</th><th>replica</th><th>rows</th><th>output tokens</th>"
            "<th>wall</th><th>tokens/s</th><th>peak memory</th><th>preemptions</th></tr>" + "".join(rows) + "</table>")


def _footer(outputs: list[ReportData]) -> str:
    made = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return (f"<footer>Made by batchgen {escape(batchgen.__version__)} at {made}. Latencies from the output rows; "
            "the charts over time from the run's timeline (_timeline.json), sampled every 0.25 s at first and more "
            "sparsely as the run grows. <code>batchgen report OUTPUT [OUTPUT...]</code> draws it again.</footer>")


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#111827;
padding:0 16px}h1{font-size:22px;margin:0 0 8px}h2{font-size:17px;margin:28px 0 8px}
code{font-size:12px;background:#f3f4f6;padding:1px 4px;border-radius:3px}ul.outputs{padding-left:18px;color:#374151}
table{border-collapse:collapse;margin:6px 0}.tables{display:flex;flex-wrap:wrap;gap:8px 40px;align-items:flex-start}td,th{border-bottom:1px solid #e5e7eb;padding:3px 10px;text-align:right;
font-variant-numeric:tabular-nums}th:first-child{text-align:left;font-weight:500}tr:first-child th{text-align:right}
td.better{color:#047857;font-weight:600}td.worse{color:#b91c1c;font-weight:600}td.same{color:#6b7280}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:18px;margin-top:18px}
figure.chart{margin:0;border:1px solid #e5e7eb;border-radius:6px;padding:10px}
figcaption{font-weight:600;margin-bottom:4px}svg{width:100%;height:auto;font-size:11px;fill:#374151}
svg text.axis{fill:#6b7280}svg text.muted{fill:#9ca3af;font-size:14px}svg text.marker{font-size:10px}
svg rect.plot{fill:#fafafa;stroke:#e5e7eb}svg line.grid{stroke:#eceff3}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;color:#374151}
.legend i{display:inline-block;width:12px;height:3px;margin-right:5px;vertical-align:middle}
.note{color:#6b7280;font-size:12px;margin:4px 0}footer{margin-top:28px;color:#6b7280;font-size:12px}
"""
