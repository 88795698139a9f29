"""The final rewrite of a job's output: the committed run parts rewritten into the final parts (input or
completion order, without `_row`) and the job report, then `_SUCCESS`. Crash-safe: the final parts are built in the temp directory
while the run parts stay; then a manifest (`_PLAN.json`: what to remove, what to move in, the summary) is
committed, and applied (again, on resume, if interrupted)."""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import sink  # its writes called through the module: tests stand in for them
from .schema import ROW_COLUMN
from .final_formats import FinalFormat
from .sink import (FINAL_PART, REPORT, REWRITE_MANIFEST, SUCCESS, OutputDir, PartFile, _row_statistics, in_row_order,
                   part_metadata, read_part)

log = logging.getLogger(__name__)


@dataclass
class RowTotals:
    """Sums over the output rows, for _SUCCESS. `rows` counts input rows: with n > 1 a row has n output rows,
    counted in `output_rows`. An error row is one output row, so rows_ok + rows_error == rows."""

    rows: int = 0
    output_rows: int = 0
    rows_ok: int = 0
    rows_error: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    generated_prompt_tokens: int = 0  # prompt tokens of the rows that were not errors

    def add(self, table: pa.Table) -> None:
        """Add a table holding every output row of its input rows (`_row` included)."""
        is_error = pc.equal(table["finish_reason"], "error")
        errors = pc.sum(is_error).as_py() or 0
        generated = pc.filter(table["prompt_tokens"], pc.invert(is_error))
        self.generated_prompt_tokens += pc.sum(generated).as_py() or 0
        rows = pc.count_distinct(table[ROW_COLUMN]).as_py()
        self.rows += rows
        self.output_rows += table.num_rows
        self.rows_error += errors
        self.rows_ok += rows - errors
        for name, column in (("prompt_tokens", "prompt_tokens"), ("output_tokens", "output_tokens"),
                             ("cached_tokens", "cached_tokens"), ("preemptions", "num_preemptions")):
            setattr(self, name, getattr(self, name) + (pc.sum(table[column]).as_py() or 0))


class FinalReport(Protocol):
    """The job report (job/report/), fed every table of the final rewrite, then rendered with the summary."""

    def add(self, table: pa.Table) -> None: ...

    def html(self, summary: dict) -> str: ...


def report_html(report: FinalReport | None, summary: dict) -> str | None:
    """The report's page; None without one, or when it fails: the output is whole without it, so a failure to draw
    it is a warning (`batchgen report OUTPUT` draws it again), not the job's."""
    if report is None:
        return None
    try:
        return report.html(summary)
    except Exception as exc:
        log.warning("the job report was not written (%s: %s); `batchgen report` draws it from the output",
                    type(exc).__name__, exc)
        return None


def finalize(out: OutputDir, schema: pa.Schema, total_rows: int, order: str, rows_per_part: int,
             summary: Callable[[RowTotals], dict], report: FinalReport | None = None,
             fmt: FinalFormat = FinalFormat()) -> dict:
    """Rewrite the run parts as the final parts (input or completion order, without `_row`; `schema` is the
    final parts', fingerprint included), the report, and write _SUCCESS. Crash-safe: the final parts are built in the
    temp directory while the run parts stay; then a manifest naming what to remove and what to move in is committed,
    and applied (again, on resume, if interrupted)."""
    if out.staging.exists():
        shutil.rmtree(out.staging)
    out.staging.mkdir(parents=True)
    run_parts = out.run_parts()
    tables = ordered_tables(run_parts, total_rows, rows_per_part) if order == "input" \
        else (read_part(p) for p in run_parts)
    totals, names = RowTotals(), []
    for index, table in enumerate(tables):  # each holds all of its input rows' samples: committed in one run part
        totals.add(table)
        if report is not None:
            report.add(table)
        for name, content in fmt.files(table.drop_columns([ROW_COLUMN]).cast(schema), index):
            write_final(out, name, content)
            names.append(name)
    if not names:  # an empty input still gets one (empty) part, so that readers find a file
        for name, content in fmt.empty(schema):
            write_final(out, name, content)
            names.append(name)
    if totals.rows != total_rows:
        raise RuntimeError(f"internal error: {totals.rows} rows committed for {total_rows} input rows")
    success = summary(totals)
    page = report_html(report, success)
    if page is not None:
        sink.atomic_write_text(out.staging / REPORT, page)
    manifest = {"remove": [p.name for p in run_parts], "add": names + ([REPORT] if page is not None else []),
                "success": success}
    sink.atomic_write_text(out.staging / REWRITE_MANIFEST, json.dumps(manifest))
    return apply_rewrite(out)


def write_final(out: OutputDir, name: str, content: pa.Table | str) -> None:
    if isinstance(content, pa.Table):
        sink.atomic_write(content, out, name, directory=out.staging)
    else:
        sink.atomic_write_text(out.staging / name, content)


def apply_rewrite(out: OutputDir) -> dict:
    """Remove the run parts, move the final parts in, write _SUCCESS, remove the temp directory.
    Every step can be repeated, so an interrupted apply is finished by applying again."""
    manifest = out.pending_rewrite()
    for name in manifest["remove"]:
        (out.path / name).unlink(missing_ok=True)
    for name in manifest["add"]:
        if (out.staging / name).exists():
            os.replace(out.staging / name, out.path / name)
    sink._fsync(out.path)
    success = {**manifest["success"], "parts": [name for name in manifest["add"] if FINAL_PART.fullmatch(name)]}
    # scratch in the temp directory: a crash or a full disk here must not leave a file in the output
    sink.atomic_write_text(out.path / SUCCESS, json.dumps(success, indent=2) + "\n", scratch_dir=out.tmp)
    shutil.rmtree(out.tmp, ignore_errors=True)
    return success


def ordered_tables(run_parts: list[PartFile], total_rows: int, rows_per_part: int) -> Iterator[pa.Table]:
    """The committed rows in input order, `rows_per_part` input positions per table (with their samples). Row groups
    carry min/max statistics of `_row` and are sorted by it when read (an `order: completion` run wrote them
    unsorted): walking the ranges in order, each row group is read once, when the first range it overlaps comes up,
    and dropped after the last one. Memory follows the sort window (how far apart rows committed together lie in the
    input), not the output size."""
    groups = []  # (min row, max row, part, row group index)
    for part in run_parts:
        metadata = part_metadata(part)
        for i in range(metadata.num_row_groups):
            if metadata.row_group(i).num_rows:
                stats = _row_statistics(metadata, i)
                groups.append((stats.min, stats.max, part, i))
    groups.sort(key=lambda g: g[0])
    loaded = 0
    active: list[tuple[int, pa.Table, np.ndarray]] = []  # (max row, rows sorted by _row, their _row values)
    for start in range(0, total_rows, rows_per_part):
        stop = start + rows_per_part
        while loaded < len(groups) and groups[loaded][0] < stop:
            high, part, i = groups[loaded][1:]
            table = in_row_order(read_part(part, row_group=i))  # unsorted if written with order: completion
            active.append((high, table, table[ROW_COLUMN].to_numpy()))
            loaded += 1
        pieces = []
        for _, table, rows in active:
            first, end = np.searchsorted(rows, [start, stop])
            if end > first:
                pieces.append(table.slice(first, end - first))
        active = [entry for entry in active if entry[0] >= stop]
        if pieces:
            yield in_row_order(pa.concat_tables(pieces))
