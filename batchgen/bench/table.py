"""Plain-text tables and the short forms of figures that the bench's reports share."""
from __future__ import annotations

from typing import Any

SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def short_dtype(dtype: str | None) -> str:
    return "-" if dtype is None else SHORT_DTYPES.get(dtype, dtype)


def _fmt(value: Any, spec: str = ",.1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def render_table(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header] + lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
           for row in [header] + lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
