"""The part writer: results buffered and committed as run parts (the output store's write_run_part: a directory's
atomic rename, or an object store's create-only put), a whole input row at a time, so that the ledger of done
input rows holds."""
from __future__ import annotations

import time
from typing import Any, Callable

import pyarrow as pa

from batchgen.engine.request import Result

from .json_output import JsonType, parse_json_output
from .schema import ID_COLUMN, JSON_COLUMN, OUTPUT_COLUMNS, RESULT_COLUMNS, ROW_COLUMN
from .parts import in_row_order, run_part_schema
from .store import OutputStore


class PartWriter:
    """Buffers output rows and commits them as run parts, each whole or not at all (OutputStore.write_run_part). A
    commit happens every `rows_per_part` output rows or `commit_interval_s` seconds, between input rows: an input
    row's samples are always committed together, so the ledger of done input rows holds."""

    def __init__(self, out: OutputStore, schema: pa.Schema, fingerprint: str, rows_per_part: int,
                 commit_interval_s: float, sort_by_row: bool, clock: Callable[[], float] = time.monotonic,
                 json_type: JsonType | None = None, on_commit: Callable[[], None] | None = None):
        self.out = out
        self.schema = run_part_schema(schema, fingerprint)
        self.rows_per_part = rows_per_part
        self.commit_interval_s = commit_interval_s
        self.sort_by_row = sort_by_row
        self.clock = clock
        self.seq = out.next_seq()
        self.columns: dict[str, list] = {name: [] for name in self.schema.names}
        self.result_columns = [column for column in RESULT_COLUMNS if column.name in self.schema.names]
        self.keep_names = [name for name in self.schema.names if name not in OUTPUT_COLUMNS and name != ROW_COLUMN]
        self.json_type = json_type  # output.parse_json: the json column's type, from sampling.json_schema
        if (JSON_COLUMN.name in self.schema.names) != (json_type is not None):
            raise ValueError("PartWriter: the schema has a json column exactly when json_type is given")
        self.last_commit = clock()
        self.committed_rows = 0
        self.on_commit = on_commit  # after each part is in place (the runner saves its timeline)

    def add(self, row: int, ident: Any, keep: tuple, *results: Result, parse_json: bool = True,
            replica: int | None = None) -> None:
        """One input row's output rows: its Result, or its n samples' (in sample order). parse_json=False: the
        row's output follows another constraint than the job's schema (a per-row one), so its `json` is null.
        replica: the Ray replica that generated it (the `replica` column of Ray runs)."""
        c = self.columns
        for result in results:
            derived = self.derive(result) if parse_json else {JSON_COLUMN.name: None} if self.json_type else {}
            if replica is not None:
                derived = {**derived, "replica": replica}
            c[ID_COLUMN.name].append(ident)
            for column in self.result_columns:
                c[column.name].append(derived[column.name] if column.name in derived else column.value(result))
            for name, value in zip(self.keep_names, keep):
                c[name].append(value)
            c[ROW_COLUMN].append(row)
        if len(c[ROW_COLUMN]) >= self.rows_per_part or self.clock() - self.last_commit >= self.commit_interval_s:
            self.commit()

    def derive(self, result: Result) -> dict[str, Any]:
        """The values the sink derives from a result rather than reads: with output.parse_json, `json` and the
        `error` of a text that gave none."""
        if self.json_type is None:
            return {}
        value, error = parse_json_output(result, self.json_type)
        return {JSON_COLUMN.name: value, "error": result.error if result.error is not None else error}

    def commit(self) -> None:
        self.last_commit = self.clock()
        if not self.columns[ROW_COLUMN]:
            return
        table = pa.table({name: pa.array(values, type=self.schema.field(name).type)
                          for name, values in self.columns.items()}, schema=self.schema)
        if self.sort_by_row:
            table = in_row_order(table)
        self.out.write_run_part(table, self.seq)
        self.seq += 1
        self.committed_rows += table.num_rows
        self.columns = {name: [] for name in self.schema.names}
        if self.on_commit is not None:
            self.on_commit()
