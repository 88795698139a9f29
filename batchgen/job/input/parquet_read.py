"""Reading the input's Parquet files so that a damaged file or a damaged value never becomes a traceback.

A file whose data cannot be decoded (or holds other than the rows its footer declares) raises InputReadError
naming the file; `scan_file` does that before the model loads. Page checksums are verified where the writer
stored them: without them, Parquet cannot tell a flipped byte inside a value from the real value.
A value that cannot become a Python value (a `string` that is not valid UTF-8, which pyarrow lets a file hold) comes
back as Unreadable, so that only its row fails; times that Python's datetime cannot hold (nanoseconds, years past
9999) come back as Arrow's integer values."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Union

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.object_store import RemoteFile, StoreError


class InputReadError(Exception):
    """An input file whose data cannot be read; the message names the file."""


@dataclass(frozen=True)
class Unreadable:
    """Stands for a value that cannot become a Python value."""

    problem: str  # follows the value's name: "is not valid UTF-8"


InputFile = Union[Path, RemoteFile]  # a local file, or an object in object storage (batchgen/object_store.py)
EMPTY: Mapping[str, str] = MappingProxyType({})  # a file in no hive partition


def open_parquet(path: InputFile) -> pq.ParquetFile:
    # pyarrow's default pre_buffer=True reads every selected column chunk of the file up front: memory would grow
    # with the input. Buffered reads of 1 MiB per column keep it to about a record batch. An object is read by range
    # requests of 8 MiB per column: each request waits out the store's latency, and 1 MiB ones read a 200k-row input
    # 3x slower from a local S3 server (dev/job_io_bench.py).
    if isinstance(path, RemoteFile):
        return pq.ParquetFile(path.open(), page_checksum_verification=True, pre_buffer=False, buffer_size=8 << 20)
    return pq.ParquetFile(path, page_checksum_verification=True, pre_buffer=False, buffer_size=1 << 20)


def file_batches(path: InputFile, columns: list[str], batch_rows: int, expected_rows: int,
                 partition: Mapping[str, str] = EMPTY) -> Iterator[pa.RecordBatch]:
    """The file's record batches of those of `columns` it has (or its `partition` gives). Raises InputReadError when
    its data cannot be decoded or it holds other than `expected_rows` rows."""
    rows = 0
    try:
        parquet = open_parquet(path)
        present = [column for column in columns if column in parquet.schema_arrow.names]
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=present):
            rows += batch.num_rows
            if rows > expected_rows:
                break
            yield with_partition(batch, columns, partition)
    except StoreError:  # the store, not the file: a runtime failure that a re-run resumes from
        raise
    except (pa.ArrowException, OSError) as exc:  # what pyarrow raises for a bad page, header or length
        raise InputReadError(f"input.path: {path} is corrupt: reading it failed after {rows} rows "
                             f"({first_line(exc)})") from None
    if rows != expected_rows:
        raise InputReadError(f"input.path: {path} is corrupt or was changed: it declared {expected_rows} rows "
                             f"but its data holds {'more' if rows > expected_rows else rows}")


def file_range(path: InputFile, columns: list[str], start: int, stop: int,
               partition: Mapping[str, str] = EMPTY) -> Iterator[pa.RecordBatch]:
    """Rows [start, stop) of the file (of those of `columns` it has), reading only the row groups that hold them.
    The file was checked by the whole-file scan before the run; this reads it again, a window at a time."""
    try:
        parquet = open_parquet(path)
        present = [column for column in columns if column in parquet.schema_arrow.names]
        first = 0
        for group in range(parquet.metadata.num_row_groups):
            end = first + parquet.metadata.row_group(group).num_rows
            if end > start and first < stop:
                table = parquet.read_row_group(group, columns=present)
                table = table.slice(max(start - first, 0), min(stop, end) - max(start, first))
                yield from (with_partition(batch, columns, partition) for batch in table.to_batches())
            first = end
            if first >= stop:
                break
    except StoreError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise InputReadError(f"input.path: {path} is corrupt: reading rows {start}-{stop} failed "
                             f"({first_line(exc)})") from None


def scan_file(path: InputFile, columns: list[str], batch_rows: int, expected_rows: int,
              partition: Mapping[str, str] = EMPTY) -> None:
    """Decode every value of `columns` once (memory: one record batch), so a corrupt file is refused before the
    model loads rather than in the middle of the run."""
    for _ in file_batches(path, columns, batch_rows, expected_rows, partition):
        pass


def with_partition(batch: pa.RecordBatch, columns: list[str], partition: Mapping[str, str]) -> pa.RecordBatch:
    """The batch with the values of its file's hive partition (`key=value` folders above it) among `columns` that the
    file does not hold itself, as string columns."""
    for name in columns:
        if name in partition and name not in batch.schema.names:
            batch = batch.append_column(name, pa.array([partition[name]] * batch.num_rows, pa.string()))
    return batch


def batch_values(batch: pa.RecordBatch) -> dict[str, list[Any]]:
    """The batch's columns as lists of Python values, Unreadable where a value cannot become one."""
    return {name: column_values(column) for name, column in zip(batch.schema.names, batch.columns)}


def column_values(column: pa.Array) -> list[Any]:
    try:
        return column.to_pylist()
    except (ValueError, OverflowError):  # one bad value fails the whole column (pyarrow checks UTF-8 only here)
        if _is_temporal(column.type):
            # Python's datetime holds neither nanoseconds nor years past 9999: keep Arrow's integer values, which
            # the output writer turns back into the same type.
            return column.cast(pa.int64() if pa.types.is_date64(column.type) or column.type.bit_width == 64
                               else pa.int32()).to_pylist()
        return [_value(column, i) for i in range(len(column))]


def _is_temporal(arrow_type: pa.DataType) -> bool:
    return pa.types.is_timestamp(arrow_type) or pa.types.is_duration(arrow_type) or pa.types.is_time(arrow_type) \
        or pa.types.is_date(arrow_type)


def _value(column: pa.Array, i: int) -> Any:
    try:
        return column[i].as_py()
    except UnicodeDecodeError:
        return Unreadable("is not valid UTF-8")
    except (ValueError, OverflowError) as exc:  # e.g. a timestamp in the year 146138
        return Unreadable(f"cannot be read: {first_line(exc)}")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
