"""The job report: `_report.html`, written beside `_SUCCESS` before it (the final rewrite feeds it every output
table, then draws it with the summary), and drawn again, of one output or of several side by side, by
`batchgen report OUTPUT [OUTPUT...]`. rows.py gathers what it needs of the rows, svg.py draws the charts,
page.py lays out the page; the charts over time come from the run's timeline (job/timeline.py)."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from batchgen.object_store import StorageConfig

from ..config import JobConfigError
from ..output.final_formats import batch_rows
from ..output.open_output import open_output
from ..output.parts import REPORT, TIMELINE, open_part, part_bytes, part_metadata, read_part
from ..timeline import parse_timeline
from .page import CHARTS, GENERATOR, ReportData, render
from .rows import COLUMNS, LATENCIES, ReportRows

__all__ = ["CHARTS", "GENERATOR", "JobReport", "REPORT", "read_output", "render", "write_report"]


class JobReport:
    """The report of the run finishing now (final_rewrite.FinalReport): fed the final rewrite's tables, drawn with
    the summary."""

    def __init__(self, label: str | Path, timeline: dict | None) -> None:
        self.label, self.timeline, self.rows = str(label), timeline, ReportRows()

    def add(self, table) -> None:
        self.rows.add(table)

    def html(self, summary: dict) -> str:
        return render([ReportData(self.label, summary, self.timeline, self.rows)])


def read_output(path: str, storage: StorageConfig = StorageConfig()) -> ReportData:
    """A finished output's report inputs: its _SUCCESS, its timeline, and its final parts' rows (a row group at a
    time, only the columns the report reads)."""
    out = open_output(path, storage)
    summary = out.success()
    if summary is None or "fingerprint" not in summary:
        raise JobConfigError(f"output: {path} holds no finished batchgen output (no _SUCCESS); the report draws "
                             f"finished outputs (`batchgen status {path}` tells how far a run is)")
    rows = ReportRows()
    fmt = ((summary.get("job") or {}).get("output") or {}).get("format", "parquet")
    for part in out.final_parts():
        if fmt == "openai-batch":
            rows.add(read_batch_part(part))
            continue
        if fmt == "jsonl":
            rows.add(read_json_part(part))
            continue
        for group in range(part_metadata(part).num_row_groups):
            rows.add(read_part(part, row_group=group, columns=list(COLUMNS)))
    return ReportData(str(out.path), summary, parse_timeline(out.read_text(TIMELINE)), rows)


def read_json_part(part) -> pa.Table:
    """A JSON lines part's columns that the report reads."""
    import pyarrow.json as pj

    table = pj.read_json(open_part(part), parse_options=pj.ParseOptions(newlines_in_values=False))
    return table.select([name for name in COLUMNS if name in table.column_names])


def read_batch_part(part) -> pa.Table:
    """An OpenAI Batch part's (or error file's) rows, as the report reads them: a row per sample."""
    text = part_bytes(part).decode()
    rows = batch_rows(text)
    types = {name: pa.float64() for name in LATENCIES} | {"finish_reason": pa.string(), "error": pa.string(),
                                                          "prompt_tokens": pa.int64(), "output_tokens": pa.int64(),
                                                          "cached_tokens": pa.int64(), "replica": pa.int64()}
    present = {name for row in rows for name in row}  # `replica` only in Ray runs' rows
    return pa.table({name: pa.array([row.get(name) for row in rows], kind) for name, kind in types.items()
                     if name in present})


def write_report(paths: list[str], target: str | None = None, storage: StorageConfig = StorageConfig()) -> str:
    """Draw the report of `paths` (side by side when several) into `target`: by default, one output's own
    _report.html, or ./batchgen-report.html for several. Returns where it went."""
    outputs = [read_output(path, storage) for path in paths]
    page = render(outputs)
    if target is None and len(paths) == 1:
        open_output(paths[0], storage).write_text(REPORT, page)
        return f"{outputs[0].label.rstrip('/')}/{REPORT}"
    target = target or "batchgen-report.html"
    Path(target).write_text(page)
    return target
