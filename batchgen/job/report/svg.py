"""Charts as inline SVG, drawn here so that the report is one file that needs no script, no library and no network:
line charts (linear or log x; a gap where a value is None), and horizontal bars. Each chart is a <figure> with
`data-chart` naming it; each series a <path> with `data-series`; hovering a point of a line shows its values."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from typing import Callable, Sequence

WIDTH, HEIGHT = 560, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 14, 40
COLORS = ("#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563")


@dataclass
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    dashed: bool = False


@dataclass
class Marker:
    """A vertical (x) or horizontal (y) rule with a label."""

    label: str
    x: float | None = None
    y: float | None = None
    color: str = "#6b7280"


@dataclass
class Axis:
    label: str
    log: bool = False
    fmt: Callable[[float], str] = field(default=lambda v: f"{v:g}")
    low: float | None = None  # forced bounds
    high: float | None = None


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        high = low + 1
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if raw <= step * m)
    first = math.ceil(low / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((high - first) / step + 1e-9) + 1)]


def log_ticks(low: float, high: float) -> list[float]:
    return [10.0 ** e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)]


def figure(chart_id: str, title: str, body: str, note: str = "", empty: bool = False) -> str:
    attrs = f' data-chart="{escape(chart_id)}"' + (' data-empty="1"' if empty else "")
    caption = f"<figcaption>{escape(title)}</figcaption>"
    return f'<figure class="chart"{attrs}>{caption}{body}' + (f'<p class="note">{escape(note)}</p>' if note else "") \
        + "</figure>"


def empty_chart(chart_id: str, title: str, why: str) -> str:
    svg = (f'<svg viewBox="0 0 {WIDTH} {HEIGHT // 3}" role="img"><text x="{WIDTH / 2}" y="{HEIGHT / 6}" '
           f'text-anchor="middle" class="muted">{escape(why)}</text></svg>')
    return figure(chart_id, title, svg, empty=True)


def line_chart(chart_id: str, title: str, series: list[Series], x: Axis, y: Axis, markers: Sequence[Marker] = (),
               note: str = "") -> str:
    points = [(px, py) for s in series for px, py in zip(s.xs, s.ys) if _drawn(px, py, x, y)]
    if not points:
        return empty_chart(chart_id, title, "no data")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    xs += [m.x for m in markers if m.x is not None]
    ys += [m.y for m in markers if m.y is not None]
    to_x, x_ticks = _scale(x, min(xs), max(xs), LEFT, WIDTH - RIGHT)
    to_y, y_ticks = _scale(y, min(ys), max(ys), HEIGHT - BOTTOM, TOP)
    parts = [_axes(to_x, x_ticks, x, to_y, y_ticks, y)]
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        path, dots = [], []
        pen_up = True
        for px, py in zip(s.xs, s.ys):
            if not _drawn(px, py, x, y):
                pen_up = True
                continue
            path.append(f"{'M' if pen_up else 'L'}{to_x(px):.1f},{to_y(py):.1f}")
            pen_up = False
        lone = [(px, py) for i, (px, py) in enumerate(zip(s.xs, s.ys)) if _drawn(px, py, x, y)
                and not (i > 0 and _drawn(s.xs[i - 1], s.ys[i - 1], x, y))
                and not (i + 1 < len(s.xs) and _drawn(s.xs[i + 1], s.ys[i + 1], x, y))]
        parts += [f'<circle class="lone" cx="{to_x(px):.1f}" cy="{to_y(py):.1f}" r="2.5" fill="{color}"/>'
                  for px, py in lone]
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        parts.append(f'<path data-series="{escape(s.label)}" d="{" ".join(path)}" fill="none" stroke="{color}" '
                     f'stroke-width="1.8"{dash}/>')
        step = max(1, len(s.xs) // 60)  # hover targets, thinned
        for px, py in list(zip(s.xs, s.ys))[::step]:
            if _drawn(px, py, x, y):
                dots.append(f'<circle cx="{to_x(px):.1f}" cy="{to_y(py):.1f}" r="3" fill="{color}" '
                            f'fill-opacity="0"><title>{escape(s.label)}: {escape(x.label)} {escape(x.fmt(px))}, '
                            f'{escape(y.label)} {escape(y.fmt(py))}</title></circle>')
        parts.append("".join(dots))
    for i, m in enumerate(markers):
        if m.x is not None:  # labels stacked, so that close markers stay readable
            px = to_x(m.x)
            left = px > WIDTH - RIGHT - 110  # near the right edge: the label to the left of its rule
            anchor = ' text-anchor="end"' if left else ""
            parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" stroke="{m.color}" '
                         f'stroke-dasharray="3 3"/><text x="{px - 3 if left else px + 3:.1f}" y="{TOP + 10 + 12 * i}" '
                         f'class="marker" fill="{m.color}"{anchor}>{escape(m.label)}</text>')
        if m.y is not None:
            py = to_y(m.y)
            parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py:.1f}" y2="{py:.1f}" stroke="{m.color}" '
                         f'stroke-dasharray="6 3"/><text x="{WIDTH - RIGHT - 3}" y="{py - 4:.1f}" class="marker" '
                         f'text-anchor="end" fill="{m.color}">{escape(m.label)}</text>')
    svg = f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img">{"".join(parts)}</svg>'
    return figure(chart_id, title, svg + _legend(series), note)


def bar_chart(chart_id: str, title: str, bars: list[tuple[str, float]], fmt: Callable[[float], str] = str,
              note: str = "", empty_text: str = "none") -> str:
    if not bars:
        return empty_chart(chart_id, title, empty_text)
    row, label_w = 22, 300
    height = TOP + row * len(bars) + 8
    top = max(value for _, value in bars) or 1
    parts = []
    for i, (label, value) in enumerate(bars):
        y = TOP + i * row
        width = (WIDTH - label_w - 70) * value / top
        short = label if len(label) <= 48 else label[:47] + "…"
        parts.append(f'<text x="{label_w - 6}" y="{y + 14}" text-anchor="end"><title>{escape(label)}</title>'
                     f'{escape(short)}</text><rect data-series="{escape(label)}" x="{label_w}" y="{y + 3}" '
                     f'width="{max(width, 1):.1f}" height="{row - 7}" fill="{COLORS[i % len(COLORS)]}"/>'
                     f'<text x="{label_w + width + 5:.1f}" y="{y + 14}">{escape(fmt(value))}</text>')
    svg = f'<svg viewBox="0 0 {WIDTH} {height}" role="img">{"".join(parts)}</svg>'
    return figure(chart_id, title, svg, note)


def _drawn(px: float, py: float | None, x: Axis, y: Axis) -> bool:
    return py is not None and _finite(px, py) and (not x.log or px > 0) and (not y.log or py > 0)


def _finite(*values: float) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _scale(axis: Axis, low: float, high: float, out_low: float, out_high: float):
    low = axis.low if axis.low is not None else low
    high = axis.high if axis.high is not None else high
    if axis.log:
        ticks = log_ticks(low, high)
        low, high = min(low, ticks[0]), max(high, ticks[-1])
        lo, hi = math.log10(low), math.log10(high)
        span = (hi - lo) or 1.0
        return (lambda v: out_low + (math.log10(v) - lo) / span * (out_high - out_low)), ticks
    if axis.low is None and low > 0 and (low < high * 0.5 or low == high):
        low = 0.0  # a quantity that starts near zero (or never changes) reads better from zero
    ticks = nice_ticks(low, high)
    low, high = min(low, ticks[0]), max(high, ticks[-1])
    span = (high - low) or 1.0
    return (lambda v: out_low + (v - low) / span * (out_high - out_low)), ticks


def _axes(to_x, x_ticks, x: Axis, to_y, y_ticks, y: Axis) -> str:
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
             f'class="plot"/>']
    for t in y_ticks:
        py = to_y(t)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py:.1f}" y2="{py:.1f}" class="grid"/>'
                     f'<text x="{LEFT - 5}" y="{py + 4:.1f}" text-anchor="end">{escape(y.fmt(t))}</text>')
    for t in x_ticks:
        px = to_x(t)
        parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" class="grid"/>'
                     f'<text x="{px:.1f}" y="{HEIGHT - BOTTOM + 15}" text-anchor="middle">{escape(x.fmt(t))}</text>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle" class="axis">'
                 f'{escape(x.label)}</text><text x="12" y="{(TOP + HEIGHT - BOTTOM) / 2}" class="axis" '
                 f'text-anchor="middle" transform="rotate(-90 12 {(TOP + HEIGHT - BOTTOM) / 2})">{escape(y.label)}'
                 f'</text>')
    return "".join(parts)


def _legend(series: list[Series]) -> str:
    if len(series) < 2:
        return ""
    items = "".join(f'<span><i style="background:{COLORS[i % len(COLORS)]}"></i>{escape(s.label)}</span>'
                    for i, s in enumerate(series))
    return f'<div class="legend">{items}</div>'
