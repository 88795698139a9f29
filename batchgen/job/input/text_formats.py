"""Inputs that are not Parquet: JSON lines and CSV files (gzipped too), and OpenAI Batch request files, each turned
once into a Parquet file in batchgen's cache (BATCHGEN_CACHE_DIR/inputs) that the job then reads like any other
(the checks, the scan, resume by row position, `plan`, Ray windows by range). The job's fingerprint keeps the
original file's identity, not the staged copy's.

Each non-blank line (a CSV record) is one row, in file order. A line that cannot be a row (bytes that are not UTF-8,
not JSON, not an object, a CSV record with another number of fields than the header, a batch request batchgen cannot
serve) is still a row: it carries its error, naming its line, in the `_input_error` column, becomes that row's error,
and the other rows run. Each line is decoded on its own (text_lines.py), so a bad byte is one line's problem.

Column types come from a first pass over the file: JSON strings, integers (floats where some are not), booleans,
lists of strings, and chat messages ([{role, content}, ...]) keep their type; anything else is kept as its JSON text.
A CSV cell is text, or an integer or float where every value of its column is one; an empty cell is null.
Memory: one batch of rows (input.read_batch_rows) at a time, in both passes. Copies unused for a week are swept."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.object_store import RemoteFile

from .openai_batch import SCHEMA as BATCH_SCHEMA
from .openai_batch import BatchEndpoint
from .parquet_read import InputFile
from .staged_columns import INPUT_ERROR_COLUMN, MESSAGES_TYPE
from .text_lines import Line, numbered_lines

FORMATS = ("parquet", "jsonl", "csv", "openai-batch")
SUFFIXES = {"parquet": (".parquet",), "jsonl": (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz"),
            "csv": (".csv", ".csv.gz"), "openai-batch": (".jsonl", ".jsonl.gz")}
STAGE_FORMAT = 4  # bump when a staged file's layout changes: older staged files are then made again
ROW_GROUP_ROWS = 8192
STAGED_KEEP_S = 7 * 86400  # a Parquet copy unused this long is removed (sweep_staged)
SCRATCH_KEEP_S = 86400  # a copy still in progress after this long belongs to a run that died


class InputFormatError(ValueError):
    """A file that cannot be read as its format at all (e.g. a CSV without a header)."""


def format_of(path: InputFile, configured: str) -> str:
    """input.format, or for `auto` the file's extension (Parquet unless it names another format)."""
    if configured != "auto":
        return configured
    name = str(path).lower()
    for fmt in ("jsonl", "csv"):
        if name.endswith(SUFFIXES[fmt]):
            return fmt
    return "parquet"


def suffixes(configured: str) -> tuple[str, ...]:
    """The names a directory's files must end in to be input files."""
    if configured == "auto":
        return SUFFIXES["parquet"] + SUFFIXES["jsonl"] + SUFFIXES["csv"]
    return SUFFIXES[configured]


@dataclass(frozen=True)
class StagedFile:
    path: Path  # the Parquet copy
    rows: int


def stage(path: InputFile, fmt: str, cache_dir: Path, batch_rows: int, numbers: tuple[str, ...] = ()) -> StagedFile:
    """The Parquet copy of a text input file, made now unless the cache holds it (same file: path, size,
    modification time or ETag). `numbers`: columns that must hold numbers (the per-row sampling keys), where a
    value of another kind among numbers is its row's error rather than turning the column into text."""
    target = cache_dir / f"{_cache_key(path, fmt, numbers)}.parquet"
    if target.is_file():
        try:
            staged = StagedFile(target, pq.read_metadata(target).num_rows)
            os.utime(target)  # its last use, for sweep_staged
            return staged
        except Exception:  # a damaged copy: made again
            pass
    rows = Rows(fmt, numbers)
    if fmt == "openai-batch":
        schema = BATCH_SCHEMA
    else:
        for record in records(path, fmt):  # pass 1: the columns and their types
            rows.observe(record)
        schema = rows.schema()
    scratch = target.with_name(f".{target.name}.{os.getpid()}.inprogress")
    count = 0
    with pq.ParquetWriter(scratch, schema, write_page_checksum=True) as writer:
        batch: list[dict] = []
        for record in records(path, fmt):  # pass 2: the rows
            batch.append(record)
            if len(batch) >= max(batch_rows, ROW_GROUP_ROWS):
                writer.write_table(rows.table(batch, schema), row_group_size=ROW_GROUP_ROWS)
                count += len(batch)
                batch = []
        if batch or not count:
            writer.write_table(rows.table(batch, schema), row_group_size=ROW_GROUP_ROWS)
            count += len(batch)
    os.replace(scratch, target)
    return StagedFile(target, count)


def sweep_staged(cache_dir: Path, now: float | None = None) -> list[Path]:
    """Remove the Parquet copies not used for STAGED_KEEP_S (stage() marks each use) and the scratch files of
    copies that were never finished; returns what went. The cache would otherwise keep a copy of every version
    of every text input ever run. A copy still needed is made again from its file; a sweep that fails is no
    failure of the job."""
    now = time.time() if now is None else now
    removed = []
    for entry in cache_dir.iterdir() if cache_dir.is_dir() else ():
        try:
            age = now - entry.stat().st_mtime
            if (entry.suffix == ".parquet" and age > STAGED_KEEP_S) or \
                    (entry.name.endswith(".inprogress") and age > SCRATCH_KEEP_S):
                entry.unlink()
                removed.append(entry)
        except OSError:
            continue
    return removed


def _cache_key(path: InputFile, fmt: str, numbers: tuple[str, ...]) -> str:
    if isinstance(path, RemoteFile):
        identity = f"{path.url}\0{path.size}\0{path.etag}"
    else:
        stat = Path(path).stat()
        identity = f"{Path(path).resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(f"{STAGE_FORMAT}\0{fmt}\0{identity}\0{sorted(numbers)}".encode()).hexdigest()[:24]


# -- records: each line (CSV record) as {column: value}, or {INPUT_ERROR_COLUMN: why} ---------------------------------

def records(path: InputFile, fmt: str) -> Iterator[dict[str, Any]]:
    lines = numbered_lines(path)
    if fmt == "csv":
        yield from _csv_records(lines)
    elif fmt == "openai-batch":
        yield from _jsonl_records(lines, BatchEndpoint().row)
    else:
        yield from _jsonl_records(lines, None)


def _jsonl_records(lines: Iterator[Line], convert: Callable[[dict, int], dict] | None) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.text.strip():
            continue
        try:
            value = json.loads(line.text)
        except ValueError as exc:
            yield {INPUT_ERROR_COLUMN: _not_utf8(line) or f"line {line.number} is not JSON: {exc}"}
            continue
        if not isinstance(value, dict):
            yield {INPUT_ERROR_COLUMN: _not_utf8(line) or f"line {line.number} is not a JSON object"}
            continue
        if INPUT_ERROR_COLUMN in value:
            value = {k: v for k, v in value.items() if k != INPUT_ERROR_COLUMN}
        record = convert(value, line.number) if convert is not None else value
        # A line with bytes that are not UTF-8 is its row's error; its values (the id, a custom_id) still name the row
        yield {**record, INPUT_ERROR_COLUMN: _not_utf8(line)} if line.not_utf8 else record


def _not_utf8(line: Line) -> str | None:
    return f"line {line.number} is not UTF-8 ({line.not_utf8})" if line.not_utf8 else None


def _csv_records(lines: Iterator[Line]) -> Iterator[dict[str, Any]]:
    not_utf8: dict[int, Line] = {}  # the lines read but not yet part of a record, that are not UTF-8

    def texts() -> Iterator[str]:
        for line in lines:
            if line.not_utf8:
                not_utf8[line.number] = line
            yield line.text

    reader = csv.reader(texts())
    try:
        header = next(reader, None)
    except csv.Error as exc:
        raise InputFormatError(f"its header cannot be read ({exc})") from None
    if not_utf8:
        raise InputFormatError(f"its header is not UTF-8 ({_not_utf8(next(iter(not_utf8.values())))})")
    if not header or len(set(header)) != len(header) or any(not name for name in header):
        raise InputFormatError("its first line must be a header naming every column once")
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise InputFormatError(f"line {reader.line_num} cannot be read ({exc})") from None
        if not fields:
            continue
        if len(fields) != len(header):
            yield {INPUT_ERROR_COLUMN: _not_utf8(not_utf8[min(not_utf8)]) if not_utf8 else
                   f"line {reader.line_num} has {len(fields)} fields, the header {len(header)}"}
        else:
            record = {name: value if value != "" else None for name, value in zip(header, fields)}
            # a record (a quoted field may span lines) holding such a line is its row's error; its id still names it
            yield {**record, INPUT_ERROR_COLUMN: _not_utf8(not_utf8[min(not_utf8)])} if not_utf8 else record
        not_utf8.clear()


# -- columns and their types ------------------------------------------------------------------------------------------

class Rows:
    """What the first pass learns of each column (the kinds of its values), and how the second writes them."""

    def __init__(self, fmt: str, numbers: tuple[str, ...] = ()) -> None:
        self.csv = fmt == "csv"
        self.numbers = numbers
        self.kinds: dict[str, set[str]] = {}

    def observe(self, record: dict[str, Any]) -> None:
        for name, value in record.items():
            self.kinds.setdefault(name, set()).add(_csv_kind(value) if self.csv else _json_kind(value))

    def schema(self) -> pa.Schema:
        fields = [pa.field(name, _arrow_type(self._number_kinds(name, kinds) - {"null"}))
                  for name, kinds in self.kinds.items() if name != INPUT_ERROR_COLUMN]
        return pa.schema(fields + [pa.field(INPUT_ERROR_COLUMN, pa.string())])

    def _number_kinds(self, name: str, kinds: set[str]) -> set[str]:
        """A numbers column's kinds without the stray ones (their rows' errors), where it holds numbers at all."""
        numeric = kinds & {"int", "float"}
        return numeric if name in self.numbers and numeric else kinds

    def table(self, batch: list[dict], schema: pa.Schema) -> pa.Table:
        numeric = [f.name for f in schema
                   if f.name in self.numbers and (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))]
        if numeric:
            batch = [self._checked(record, numeric) for record in batch]
        columns = {}
        for field in schema:
            values = [record.get(field.name) for record in batch]
            columns[field.name] = pa.array([_as(value, field.type, self.csv) for value in values], field.type)
        return pa.table(columns, schema=schema)


    def _checked(self, record: dict[str, Any], numeric: list[str]) -> dict[str, Any]:
        """The record with a non-number in a numbers column taken out, and said in its row's error."""
        kind = _csv_kind if self.csv else _json_kind
        stray = [name for name in numeric if kind(record.get(name)) not in ("int", "float", "null")]
        if not stray:
            return record
        error = record.get(INPUT_ERROR_COLUMN) or "; ".join(
            f"{name} is {record[name] if self.csv else json.dumps(record[name], ensure_ascii=False)[:80]}, "
            f"not a number" for name in stray)
        return {**record, **{name: None for name in stray}, INPUT_ERROR_COLUMN: error}


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if -2**63 <= value < 2**63 else "other"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list) and value and all(_is_message(item) for item in value):
        return "messages"
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return "strings"
    return "other"


def _is_message(item: Any) -> bool:
    return isinstance(item, dict) and set(item) <= {"role", "content"} and isinstance(item.get("role"), str) \
        and isinstance(item.get("content"), str)


def _csv_kind(value: str | None) -> str:
    if value is None:
        return "null"
    for kind, parse in (("int", int), ("float", float)):
        try:
            parse(value)
            return kind if kind != "int" or -2**63 <= int(value) < 2**63 else "other"
        except ValueError:
            continue
    return "str"


def _arrow_type(kinds: set[str]) -> pa.DataType:
    if not kinds or kinds == {"str"}:
        return pa.string()
    if kinds == {"bool"}:
        return pa.bool_()
    if kinds == {"int"}:
        return pa.int64()
    if kinds <= {"int", "float"}:
        return pa.float64()
    if kinds == {"messages"}:
        return MESSAGES_TYPE
    if kinds == {"strings"}:
        return pa.list_(pa.string())
    return pa.string()  # mixed or nested: the values' JSON text


def _as(value: Any, arrow_type: pa.DataType, from_csv: bool) -> Any:
    if value is None:
        return None
    if from_csv:
        return int(value) if pa.types.is_int64(arrow_type) else float(value) if pa.types.is_float64(arrow_type) \
            else value
    if pa.types.is_string(arrow_type) and not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if pa.types.is_float64(arrow_type):
        return float(value)
    return value
