"""The final rewrite of a job's output, for either kind of store (store.py): the committed run parts rewritten into
the final parts (input or completion order, without `_row`) and the job report, then `_SUCCESS`. Crash-safe: the
final parts are written while the run parts stay (staged: in a local output's temp directory; in an object store,
where readers see them, over any a killed rewrite left); then a manifest (`_PLAN.json`: what to remove, what to
publish, the summary) is committed, and applied (again, on resume, if interrupted)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .column_names import ROW_COLUMN
from .final_formats import FinalFormat
from .schema import error_mask
from .parts import (FINAL_PART, REPORT, REWRITE_MANIFEST, SUCCESS, PartFile, in_row_order, part_metadata, read_part,
                    row_statistics)
from .store import OutputStore

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
    # the tasks other than generate (each counted where the table has its column):
    truncated_rows: int = 0  # embed, classify: rows cut to the model's maximum length
    scored_tokens: int = 0  # score: tokens scored, over all rows
    embedding_dimensions: int | None = None  # embed: the first embedding's length

    def add(self, table: pa.Table) -> None:
        """Add a table holding every output row of its input rows (`_row` included)."""
        is_error = error_mask(table)
        errors = pc.sum(is_error).as_py() or 0
        generated = pc.filter(table["prompt_tokens"], pc.invert(is_error))
        self.generated_prompt_tokens += pc.sum(generated).as_py() or 0
        rows = pc.count_distinct(table[ROW_COLUMN]).as_py()
        self.rows += rows
        self.output_rows += table.num_rows
        self.rows_error += errors
        self.rows_ok += rows - errors
        for name, column in (("prompt_tokens", "prompt_tokens"), ("output_tokens", "output_tokens"),
                             ("cached_tokens", "cached_tokens"), ("preemptions", "num_preemptions"),
                             ("scored_tokens", "num_scored_tokens")):
            if column in table.column_names:  # output tokens: generate's alone; scored tokens: score's
                setattr(self, name, getattr(self, name) + (pc.sum(table[column]).as_py() or 0))
        if "num_truncated_tokens" in table.column_names:
            self.truncated_rows += pc.sum(pc.greater(table["num_truncated_tokens"], 0)).as_py() or 0
        if "embedding" in table.column_names and self.embedding_dimensions is None:
            lengths = pc.drop_null(pc.list_value_length(table["embedding"]))
            self.embedding_dimensions = lengths[0].as_py() if len(lengths) else None


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


def finalize(out: OutputStore, schema: pa.Schema, total_rows: int, order: str, rows_per_part: int,
             summary: Callable[[RowTotals], dict], report: FinalReport | None = None,
             fmt: FinalFormat = FinalFormat()) -> dict:
    """Rewrite the run parts the ledger counts as the final parts (input or completion order, without `_row`;
    `schema` is the final parts', fingerprint included), the report, and write _SUCCESS. Crash-safe: the final
    parts are staged while the run parts stay; then a manifest naming what to remove and what to publish is
    committed, and applied (again, on resume, if interrupted)."""
    counted, superseded = out.ledger_parts(total_rows)
    stale = [part.name for part in out.final_parts()]  # a killed rewrite's, where it wrote in place
    out.begin_rewrite()
    tables = ordered_tables(counted, total_rows, rows_per_part) if order == "input" \
        else (read_part(p) for p in counted)
    totals, names = RowTotals(), []
    for index, table in enumerate(tables):  # each holds all of its input rows' samples: committed in one run part
        totals.add(table)
        if report is not None:
            report.add(table)
        for name, content in fmt.files(table.drop_columns([ROW_COLUMN]).cast(schema), index):
            out.write(name, content, staged=True)
            names.append(name)
    if not names:  # an empty input still gets one (empty) part, so that readers find a file
        for name, content in fmt.empty(schema):
            out.write(name, content, staged=True)
            names.append(name)
    if totals.rows != total_rows:
        raise RuntimeError(f"internal error: {totals.rows} rows committed for {total_rows} input rows")
    for name in stale:  # a killed rewrite's parts beyond this one's
        if name not in names:
            out.delete(name)
    success = summary(totals)
    page = report_html(report, success)
    if page is not None:
        out.write(REPORT, page, staged=True)
    manifest = {"remove": [p.name for p in counted + superseded], "add": names + ([REPORT] if page is not None else []),
                "success": success}
    out.write(REWRITE_MANIFEST, json.dumps(manifest), staged=True)
    return apply_rewrite(out)


def apply_rewrite(out: OutputStore) -> dict:
    """Remove the run parts, publish the final parts and the report, write _SUCCESS (naming the final parts), drop
    the manifest and the scratch. Every step can be repeated, so an interrupted apply is finished by applying
    again."""
    manifest = out.pending_rewrite()
    for name in manifest["remove"]:
        out.delete(name)
    out.publish(manifest["add"])
    success = {**manifest["success"], "parts": [name for name in manifest["add"] if FINAL_PART.fullmatch(name)]}
    # a local output's scratch is in its temp directory: a crash or a full disk here leaves no file in the output
    out.write(SUCCESS, json.dumps(success, indent=2) + "\n")
    out.end_rewrite()
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
                stats = row_statistics(metadata, i)
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
