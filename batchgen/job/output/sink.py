"""The output side of a job: Parquet part files committed atomically, and the resume ledger (part_writer.py buffers
results into them; the final rewrite into input or completion order, followed by `_SUCCESS`, is final_rewrite.py).

Layout of `output.path` while a job runs:
    run-00000.parquet ...   committed parts in completion order, with an extra `_row` column (input position)
and once it has finished:
    part-00000.parquet ...  the output, without `_row`
    _report.html            the job report (job/report/), written before _SUCCESS
    _SUCCESS                the run summary (JSON)
and, from the first commit on, `_timeline.json` (job/timeline.py), the run's samples over time for the report.
Their leading underscore keeps them out of directory readers (pyarrow datasets, pandas, Spark), as it does _SUCCESS.
Anything not yet committed lives in the sibling directory `.<name>.batchgen-tmp/` (beside the output's real path),
removed after success. It holds a mark naming its output: a directory there without it is someone else's, and
batchgen neither writes into nor removes it.
The committed run parts are the ledger: their `_row` columns say which input rows are done (with n > 1 samples per
row, a row's samples are always committed in the same part, so a done row has all of them).

Every part carries the job's fingerprint in its Parquet metadata: that, not its name, makes a file batchgen's
(only such files are ever deleted). Parts are written with page checksums, read back with them verified."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.object_store import RemoteFile

from ..input.parquet_read import first_line
from .schema import ROW_COLUMN, SAMPLE_COLUMN

PartFile = Union[Path, RemoteFile]  # a part in a local output directory, or an object in an object-store output
FINGERPRINT_KEY = b"batchgen.fingerprint"
SUCCESS = "_SUCCESS"
TIMELINE = "_timeline.json"
REPORT = "_report.html"
# batchgen's own side files, each known by a mark inside it (their names alone do not make them batchgen's)
SIDE_FILE_MARKS = {TIMELINE: "batchgen-timeline/", REPORT: '<meta name="generator" content="batchgen">'}
REWRITE_MANIFEST = "_PLAN.json"  # the final rewrite's manifest (final_rewrite.py); the name on disk predates `batchgen plan`
# Where older versions half-wrote _SUCCESS (its scratch now lives in the temp directory): batchgen's own, removed when
# a run takes the output.
RUN_PART_ROW_GROUP = 1024  # rows: the final rewrite reads run parts a row group at a time
LEFTOVER_SUCCESS_SCRATCH = SUCCESS + ".inprogress"
TMP_SUFFIX = ".batchgen-tmp"
SCRATCH_MARK = "batchgen-scratch.json"  # in the temp directory: {"output": the output's real path}
RUN_PART = re.compile(r"run-(\d+)\.parquet")
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


def _is_part_name(name: str) -> bool:
    return bool(RUN_PART.fullmatch(name) or FINAL_PART.fullmatch(name))


def _source(part: PartFile) -> Any:
    return part.open() if isinstance(part, RemoteFile) else part


def read_part_schema(path: PartFile) -> pa.Schema:
    """A part file's schema with its metadata, from the footer alone."""
    with _reading(path, "not a readable Parquet file"):
        return pq.read_schema(_source(path))


def part_metadata(path: PartFile) -> pq.FileMetaData:
    with _reading(path, "not a readable Parquet file"):
        return pq.ParquetFile(_source(path)).metadata


def read_part(path: PartFile, row_group: int | None = None, columns: list[str] | None = None) -> pa.Table:
    """A part file (or one of its row groups; or only `columns`, those of them it has), every page checked against
    its checksum."""
    with _reading(path, "its data cannot be read"):
        parquet = pq.ParquetFile(_source(path), page_checksum_verification=True)
        if columns is not None:
            columns = [name for name in columns if name in parquet.schema_arrow.names]
        return parquet.read(columns) if row_group is None else parquet.read_row_group(row_group, columns)


def run_part_rows(part: PartFile) -> np.ndarray:
    """A run part's `_row` values. Every page is read (checksums verified) and each row group's `_row` statistics
    checked against its values: the final rewrite finds row groups by those statistics, which no checksum covers."""
    with _reading(part, "its data cannot be read"):
        parquet = pq.ParquetFile(_source(part), page_checksum_verification=True)
        pieces = []
        for i in range(parquet.num_row_groups):
            rows = parquet.read_row_group(i).column(ROW_COLUMN).to_numpy()
            stats = _row_statistics(parquet.metadata, i)
            if rows.size and (stats is None or (stats.min, stats.max) != (rows.min(), rows.max())):
                raise DamagedFileError(part, f"the statistics of its row group {i} do not match its rows")
            pieces.append(rows)
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)


def _row_statistics(metadata: pq.FileMetaData, row_group: int) -> pq.Statistics | None:
    # _row is a run part's last column and a flat one, so its leaf is the last (a nested keep column before it
    # has several leaves: the Arrow field index is not the Parquet column index)
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


class OutputDir:
    """`output.path` and its temp directory, and what a previous run left in them."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # one temp directory (and lock) per real directory, whichever symlinked path names it
        self.real = Path(os.path.realpath(self.path))
        self.tmp = self.real.parent / f".{self.real.name}{TMP_SUFFIX}"
        self.staging = self.tmp / "final"

    # -- whose files are where --------------------------------------------------------------------------------

    def tmp_is_ours(self) -> bool:
        """The temp directory is this output's: absent, marked as this output's, or left by an older batchgen
        (unmarked, holding only what batchgen puts there)."""
        if not os.path.lexists(self.tmp):
            return True
        if self.tmp.is_symlink() or not self.tmp.is_dir():
            return False
        mark = self.tmp / SCRATCH_MARK
        if mark.is_file():
            try:
                return json.loads(mark.read_text()).get("output") == str(self.real)
            except (ValueError, OSError, AttributeError):
                return False
        return all(_is_scratch_entry(entry) for entry in self.tmp.iterdir())

    def make_tmp(self) -> None:
        """Create the temp directory (once tmp_is_ours said it may) and mark it as this output's."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        if not (self.tmp / SCRATCH_MARK).is_file():
            atomic_write_text(self.tmp / SCRATCH_MARK, json.dumps({"output": str(self.real)}))

    def enclosing_output(self) -> Path | None:
        """A directory above this output that holds another job's output (or is batchgen's temp directory)."""
        for parent in self.real.parents:
            if parent.name.endswith(TMP_SUFFIX) or is_output_dir(parent):
                return parent
        return None

    def nested_output(self) -> Path | None:
        """Another job's output inside this one, in a hidden directory (a visible one is a foreign name)."""
        for name in self.names():
            top = self.path / name
            if not name.startswith(".") or top.is_symlink() or not top.is_dir():
                continue
            for folder, _, _ in os.walk(top):
                if is_output_dir(Path(folder)):
                    return Path(folder)
        return None

    def names(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []

    def run_parts(self) -> list[Path]:
        return [self.path / n for n in self.names() if RUN_PART.fullmatch(n)]

    def final_parts(self) -> list[Path]:
        return [self.path / n for n in self.names() if FINAL_PART.fullmatch(n)]

    def foreign_names(self) -> list[str]:
        """Files batchgen did not write (hidden files aside). Its names are not enough: a part file is batchgen's
        when it carries a fingerprint, _SUCCESS when it holds batchgen's summary. A part file whose footer cannot
        be read is neither: DamagedFileError."""
        names = [n for n in self.names() if not n.startswith(".") and n != LEFTOVER_SUCCESS_SCRATCH]
        unknown = [n for n in names if n != SUCCESS and n not in SIDE_FILE_MARKS and not _is_part_name(n)]
        return unknown or [n for n in names if not self.carries_fingerprint(n)]

    def carries_fingerprint(self, name: str) -> bool:
        if name == SUCCESS:
            return "fingerprint" in (self.success() or {})
        if name in SIDE_FILE_MARKS:
            return is_side_file(name, self.read_text(name))
        if name.endswith(".jsonl"):  # JSON lines carry no footer: batchgen's when its _SUCCESS names them
            return name in (self.success() or {}).get("parts", [])
        return FINGERPRINT_KEY in (read_part_schema(self.path / name).metadata or {})

    def read_text(self, name: str) -> str | None:
        """A side file's text (None without one, or when it is not text)."""
        try:
            return (self.path / name).read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def write_text(self, name: str, text: str) -> None:
        """A side file, whole or not at all. Its scratch: in the temp directory while a run holds the output; a
        finished output has none (`batchgen report` rewrites its report), and then a hidden file beside it."""
        if self.tmp.is_dir():
            atomic_write_text(self.path / name, text, scratch_dir=self.tmp)
        else:
            atomic_write_text(self.path / name, text, scratch_name=f".{name}.inprogress")

    def success(self) -> dict | None:
        """The _SUCCESS summary; None without one, or when the file there is not batchgen's JSON."""
        path = self.path / SUCCESS
        if not path.is_file():
            return None
        try:
            summary = json.loads(path.read_text())
        except ValueError:  # not JSON, or not UTF-8 (e.g. another tool's marker file)
            return None
        return summary if isinstance(summary, dict) else None

    def pending_rewrite(self) -> dict | None:
        """A finalization that was decided but maybe not fully applied (a crash during the final renames)."""
        path = self.staging / REWRITE_MANIFEST
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            raise DamagedFileError(path, "not valid JSON") from None

    def run_part_schemas(self) -> dict[Path, pa.Schema]:
        return {part: read_part_schema(part) for part in self.run_parts()}

    def done_rows(self, total_rows: int) -> bytearray:
        """The ledger: done[row] is 1 for every input row already committed. Every run part is read whole, so that
        a damaged one is found now (DamagedFileError) rather than by the final rewrite."""
        done = bytearray(total_rows)
        marks = np.frombuffer(done, dtype=np.uint8)
        for part in self.run_parts():
            rows = run_part_rows(part)
            if rows.size and (rows.min() < 0 or rows.max() >= total_rows):
                raise DamagedFileError(part, f"its {ROW_COLUMN} column names rows outside the input's {total_rows}")
            marks[rows] = 1
        return done

    def next_seq(self) -> int:
        seqs = [int(RUN_PART.fullmatch(p.name).group(1)) for p in self.run_parts()]
        return max(seqs, default=-1) + 1

    def write_run_part(self, table: pa.Table, seq: int) -> None:
        atomic_write(table, self, f"run-{seq:05d}.parquet", row_group_size=RUN_PART_ROW_GROUP)

    def prepare_tmp(self) -> None:
        """Create the temp directory; drop half-written files a killed run left there."""
        self.make_tmp()
        for stray in self.tmp.glob("*.inprogress"):
            stray.unlink()
        (self.path / LEFTOVER_SUCCESS_SCRATCH).unlink(missing_ok=True)

    def remove_outputs(self) -> None:
        """--overwrite: remove everything batchgen wrote (never foreign files)."""
        ours = [name for name in self.names()  # all decided first: _SUCCESS names the JSON lines parts
                if (name in (SUCCESS, *SIDE_FILE_MARKS) or _is_part_name(name)) and self.carries_fingerprint(name)]
        for name in ours:
            (self.path / name).unlink()
        if self.staging.exists():
            shutil.rmtree(self.staging)
        self.prepare_tmp()


def _is_scratch_entry(entry: Path) -> bool:
    """What batchgen puts in a temp directory: the lock, half-written files, the final parts being staged."""
    if entry.is_symlink():
        return False
    if entry.name == "lock" or entry.name.endswith(".inprogress"):
        return entry.is_file()
    if entry.name == "final" and entry.is_dir():
        return all(not p.is_symlink() and p.is_file() and (FINAL_PART.fullmatch(p.name) or p.name == REWRITE_MANIFEST
                                                           or p.name == REPORT or p.name.endswith(".inprogress"))
                   for p in entry.iterdir())
    return False


def is_output_dir(path: Path) -> bool:
    """Whether `path` holds a batchgen job's output, finished or not: its _SUCCESS, a part file carrying a
    fingerprint, or a temp directory marked as its own (a run that has committed nothing yet)."""
    out = OutputDir(path)
    try:
        if not path.is_dir():
            return False
        if "fingerprint" in (out.success() or {}):
            return True
        part = next((name for name in out.names() if _is_part_name(name)), None)
        if part is not None and out.carries_fingerprint(part):
            return True
        mark = out.tmp / SCRATCH_MARK
        return mark.is_file() and json.loads(mark.read_text()).get("output") == str(out.real)
    except (OSError, ValueError, AttributeError, DamagedFileError):  # unreadable: not provably an output
        return False


def in_row_order(table: pa.Table) -> pa.Table:
    """Sorted by input position, a row's samples by their number."""
    keys = [ROW_COLUMN] + ([SAMPLE_COLUMN] if SAMPLE_COLUMN in table.schema.names else [])
    return table.sort_by([(key, "ascending") for key in keys])


def atomic_write(table: pa.Table, out: OutputDir, name: str, row_group_size: int | None = None,
                 directory: Path | None = None) -> None:
    """Write under the temp directory, fsync, then rename to `directory/name` (default: the output path)."""
    target = (directory or out.path) / name
    scratch = out.tmp / f"{name}.inprogress"
    pq.write_table(table, scratch, row_group_size=row_group_size, write_page_checksum=True)
    _fsync(scratch)
    os.replace(scratch, target)
    _fsync(target.parent)


def atomic_write_text(path: Path, text: str, scratch_dir: Path | None = None, scratch_name: str | None = None) -> None:
    """Write `path` whole or not at all; the half-written scratch file lives in `scratch_dir` (default: beside it)."""
    scratch = (scratch_dir or path.parent) / (scratch_name or path.name + ".inprogress")
    scratch.write_text(text)
    _fsync(scratch)
    os.replace(scratch, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
