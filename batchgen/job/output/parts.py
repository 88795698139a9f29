"""What an output holds, by name, and its part files: the names both kinds of store use (store.py), the
fingerprint every part carries, and reading a part back with its checksums verified (a local Path or an object's
RemoteFile alike).

An output, while a job runs and once it has finished (a local directory and an object-store prefix alike):
    run-<seq>[-<run id>].parquet   committed run parts in completion order, with an extra `_row` column (input
                                   position): the resume ledger
    part-00000.parquet ...         the final rewrite's parts, without `_row` (errors-*.jsonl too, for openai-batch)
    _report.html                   the job report (job/report/), written before _SUCCESS
    _SUCCESS                       the run summary (JSON), last: it names the final parts
    _timeline.json                 from the first commit on (job/timeline.py), the runs' samples over time
Their leading underscore keeps them out of directory readers (pyarrow datasets, pandas, Spark), as it does _SUCCESS.
Every part carries the job's fingerprint in its Parquet metadata: that, not its name, makes a file batchgen's
(only such files are ever deleted). Parts are written with page checksums, read back with them verified."""
from __future__ import annotations

import errno
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.object_store import RemoteFile

from ..input.parquet_read import first_line
from .column_names import ROW_COLUMN, SAMPLE_COLUMN

PartFile = Union[Path, RemoteFile]  # a part in a local output directory, or an object in an object-store output
FINGERPRINT_KEY = b"batchgen.fingerprint"
SUCCESS = "_SUCCESS"
TIMELINE = "_timeline.json"
REPORT = "_report.html"
CALIBRATION = "_calibration.json"  # quantization_calibration's measurement, reused on resume (job/calibration.py)
# batchgen's own side files, each known by a mark inside it (their names alone do not make them batchgen's)
SIDE_FILE_MARKS = {TIMELINE: "batchgen-timeline/", REPORT: '<meta name="generator" content="batchgen">',
                   CALIBRATION: "batchgen-calibration/"}
REWRITE_MANIFEST = "_PLAN.json"  # the final rewrite's manifest (final_rewrite.py); the name on disk predates `batchgen plan`
RUN_PART_ROW_GROUP = 1024  # rows: the final rewrite reads run parts a row group at a time
RUN_PART = re.compile(r"run-(\d+)\.parquet")  # in a local directory, where a part is renamed into place
# in object storage, where a run part cannot be renamed into place: named by its sequence and its run's id
OBJECT_RUN_PART = re.compile(r"run-(\d+)-([0-9a-f]+)\.parquet")
FINAL_PART = re.compile(r"(?:part|errors)-(\d+)\.(?:parquet|jsonl)")  # errors-*: output.format openai-batch


def run_part_schema(schema: pa.Schema, fingerprint: str) -> pa.Schema:
    return final_part_schema(schema, fingerprint).append(pa.field(ROW_COLUMN, pa.int64()))


def final_part_schema(schema: pa.Schema, fingerprint: str) -> pa.Schema:
    return schema.with_metadata({FINGERPRINT_KEY: fingerprint.encode()})


class DamagedFileError(Exception):
    """A file in the output that batchgen cannot read back (e.g. truncated by a failing disk)."""

    def __init__(self, path: PartFile, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def is_side_file(name: str, text: str | None) -> bool:
    """Whether `text` is batchgen's side file `name` (TIMELINE or REPORT)."""
    return text is not None and SIDE_FILE_MARKS[name] in text[:4096]


def open_part(part: PartFile) -> Any:
    """What pyarrow reads a part from: a local path as it is, an object as a file that reads byte ranges."""
    return part.open() if isinstance(part, RemoteFile) else part


def part_bytes(part: PartFile) -> bytes:
    """A part's whole content (a JSON lines part, read back by the report)."""
    return part.open().read() if isinstance(part, RemoteFile) else Path(part).read_bytes()


def read_part_schema(path: PartFile) -> pa.Schema:
    """A part file's schema with its metadata, from the footer alone."""
    with _reading(path, "not a readable Parquet file"):
        return pq.read_schema(open_part(path))


def part_metadata(path: PartFile) -> pq.FileMetaData:
    with _reading(path, "not a readable Parquet file"):
        return pq.ParquetFile(open_part(path)).metadata


def read_part(path: PartFile, row_group: int | None = None, columns: list[str] | None = None) -> pa.Table:
    """A part file (or one of its row groups; or only `columns`, those of them it has), every page checked against
    its checksum."""
    with _reading(path, "its data cannot be read"):
        parquet = pq.ParquetFile(open_part(path), page_checksum_verification=True)
        if columns is not None:
            columns = [name for name in columns if name in parquet.schema_arrow.names]
        return parquet.read(columns) if row_group is None else parquet.read_row_group(row_group, columns)


def run_part_rows(part: PartFile) -> np.ndarray:
    """A run part's `_row` values. Every page is read (checksums verified) and each row group's `_row` statistics
    checked against its values: the final rewrite finds row groups by those statistics, which no checksum covers."""
    with _reading(part, "its data cannot be read"):
        parquet = pq.ParquetFile(open_part(part), page_checksum_verification=True)
        pieces = []
        for i in range(parquet.num_row_groups):
            rows = parquet.read_row_group(i).column(ROW_COLUMN).to_numpy()
            stats = row_statistics(parquet.metadata, i)
            if rows.size and (stats is None or (stats.min, stats.max) != (rows.min(), rows.max())):
                raise DamagedFileError(part, f"the statistics of its row group {i} do not match its rows")
            pieces.append(rows)
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)


def row_statistics(metadata: pq.FileMetaData, row_group: int) -> pq.Statistics | None:
    """A run part's row group's `_row` min/max. _row is a run part's last column and a flat one, so its leaf is the
    last (a nested keep column before it has several leaves: the Arrow field index is not the Parquet column
    index)."""
    stats = metadata.row_group(row_group).column(metadata.num_columns - 1).statistics
    return stats if stats is not None and stats.has_min_max else None


@contextmanager
def _reading(path: PartFile, what: str) -> Iterator[None]:
    """Bad bytes as DamagedFileError: pyarrow raises ArrowException, UnicodeDecodeError (a name in the footer) or
    an OSError without errno (a checksum mismatch), the disk EIO. An OS refusal (a permission) stays an OSError."""
    try:
        yield
    except (pa.ArrowException, ValueError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in (None, errno.EIO):
            raise
        raise DamagedFileError(path, f"{what} ({first_line(exc)})") from None


def in_row_order(table: pa.Table) -> pa.Table:
    """Sorted by input position, a row's samples by their number."""
    keys = [ROW_COLUMN] + ([SAMPLE_COLUMN] if SAMPLE_COLUMN in table.schema.names else [])
    return table.sort_by([(key, "ascending") for key in keys])


def parquet_bytes(table: pa.Table, row_group_size: int | None = None) -> bytes:
    """A table as a Parquet file's bytes, page checksums written (an object is put whole, from bytes)."""
    stream = pa.BufferOutputStream()
    pq.write_table(table, stream, row_group_size=row_group_size, write_page_checksum=True)
    return stream.getvalue().to_pybytes()  # obstore takes bytes, not an Arrow buffer
