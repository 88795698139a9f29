"""The output-store protocol: everything the job layer does with an output, wherever it lies. Two kinds implement
its primitives: a local directory (output_dir.py, `OutputDir`: rename, fsync and an flock) and an object-store
prefix (object_output.py, `ObjectOutput`: create-only PUTs and a lease). What stands on those primitives is written
once, here and above: which entries are batchgen's, the ledger of committed rows, the run parts' writing, the output
check (resume.check_output), the final rewrite (final_rewrite.finalize, apply_rewrite) and `batchgen status`.
Nothing outside the two implementations asks which kind an output is (tests/test_layout.py checks it).

The primitives, by what they promise:
    listing, read          what the output holds (hidden names aside in an object store), an entry's bytes
    write                  an entry whole or not at all; `create`: write-if-absent (an object store's conditional
                           PUT; in a directory the run's flock makes the new name its own and the rename puts it whole)
    delete                 an entry, gone already or not
    lock, unlock           one run writes at a time: the flock, or the lease (lease.py); holder, busy_message: who
                           holds it now, as `batchgen status` and `batchgen plan` say it
    check_location         the refusals of where the output is (nested in another job's output, or holding one)
    staged writes          the final rewrite's files before `publish`: a directory builds them in its temp
                           directory and renames them in; an object store, which has no rename, writes them where
                           readers see them (`rewrites_in_place`), and `_SUCCESS` alone says the output is whole"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from re import Pattern
from typing import Any

import numpy as np
import pyarrow as pa

from .column_names import ROW_COLUMN
from .parts import (FINAL_PART, FINGERPRINT_KEY, REWRITE_MANIFEST, RUN_PART_ROW_GROUP, SIDE_FILE_MARKS, SUCCESS,
                    DamagedFileError, PartFile, is_side_file, read_part_schema, run_part_rows)

Content = pa.Table | str | bytes  # a table is written as a Parquet file with page checksums


class OutputStore(ABC):
    """An output and what earlier runs left in it. Subclasses set the class attributes and the primitives."""

    path: Any  # what messages name: the local Path, or the output's URL
    noun: str  # what refusals call its entries: "files" or "objects"
    run_part: Pattern  # the names of its run parts; group 1 is the sequence number
    markers: tuple[str, ...] = ()  # batchgen's entries known by their name alone (the lease, the manifest)
    lock_name: str | None = None  # the entry that is the output's lock, which --overwrite keeps
    ignored: tuple[str, ...] = ()  # names neither batchgen's nor foreign (what an older batchgen left)
    rewrites_in_place: bool = False  # final parts are written where readers see them (see the docstring)

    def __init__(self) -> None:
        self._ledger: tuple[list[PartFile], list[PartFile]] | None = None  # (counted, superseded) run parts

    # -- the primitives ---------------------------------------------------------------------------------------

    @abstractmethod
    def listing(self) -> dict[str, PartFile]:
        """Every entry of the output by its name."""

    @abstractmethod
    def read(self, name: str, staged: bool = False) -> bytes | None:
        """An entry's bytes; None when there is none. `staged`: the final rewrite's file of that name."""

    @abstractmethod
    def write(self, name: str, content: Content, row_group_size: int | None = None, create: bool = False,
              staged: bool = False) -> PartFile:
        """Write an entry whole or not at all, and return it."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove an entry (absent already: fine)."""

    @abstractmethod
    def file(self, name: str, staged: bool = False) -> PartFile:
        """The entry's file, as errors name it."""

    @abstractmethod
    def lock(self) -> None:
        """Take the output for this run, or raise OutputBusy (exit 75)."""

    @abstractmethod
    def unlock(self) -> None:
        """Give the output up (taken or not)."""

    @abstractmethod
    def holder(self) -> str | None:
        """The run holding the output now, as `batchgen status` names it; None when none does."""

    @abstractmethod
    def busy_message(self) -> str | None:
        """What `batchgen plan` says when a run holds the output now (None when none does)."""

    @abstractmethod
    def check_location(self) -> None:
        """Refuse (JobConfigError) an output where batchgen may not write: inside another job's output, holding
        one, or (a directory) one it cannot write."""

    @abstractmethod
    def run_part_name(self, seq: int) -> str:
        """The name of this run's run part number `seq`."""

    @abstractmethod
    def commit_time(self, part: PartFile) -> float:
        """When a run part was committed (epoch seconds)."""

    @abstractmethod
    def begin_rewrite(self) -> None:
        """Before the final rewrite writes its first staged file."""

    @abstractmethod
    def publish(self, names: list[str]) -> None:
        """Put the staged files `names` where readers see them (those already there: fine)."""

    @abstractmethod
    def end_rewrite(self) -> None:
        """After _SUCCESS: drop the manifest and the rewrite's scratch."""

    @abstractmethod
    def is_staged(self, part: PartFile) -> bool:
        """Whether `part` is one of the final rewrite's files not yet published."""

    @abstractmethod
    def discard_scratch(self) -> None:
        """A finished output found while locked: drop what runs keep beside it."""

    @abstractmethod
    def reset_scratch(self) -> None:
        """After --overwrite removed batchgen's entries: the scratch a fresh run starts with."""

    # -- what is there ----------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self.listing())

    def run_parts(self) -> list[PartFile]:
        """In the order of their sequence numbers (completion order), then names (an object's run ids)."""
        found = [(self.run_part.fullmatch(name), file) for name, file in self.listing().items()]
        return [file for match, file in sorted((f for f in found if f[0]), key=lambda f: (int(f[0][1]), f[0][0]))]

    def final_parts(self) -> list[PartFile]:
        return [file for name, file in sorted(self.listing().items()) if FINAL_PART.fullmatch(name)]

    def is_part_name(self, name: str) -> bool:
        return bool(self.run_part.fullmatch(name) or FINAL_PART.fullmatch(name))

    def read_text(self, name: str) -> str | None:
        """A side file's text (None without one, or when it is not text; a local file that cannot be read)."""
        try:
            data = self.read(name)
        except OSError:
            return None
        try:
            return data.decode() if data is not None else None
        except UnicodeDecodeError:
            return None

    def write_text(self, name: str, text: str) -> None:
        self.write(name, text)

    def success(self) -> dict | None:
        """The _SUCCESS summary; None without one, or when what is there is not batchgen's JSON."""
        data = self.read(SUCCESS)
        try:
            summary = json.loads(data) if data is not None else None
        except ValueError:  # not JSON, or not UTF-8 (e.g. another tool's marker file)
            return None
        return summary if isinstance(summary, dict) else None

    def pending_rewrite(self) -> dict | None:
        """A final rewrite that was decided (its manifest written) but maybe not fully applied."""
        data = self.read(REWRITE_MANIFEST, staged=True)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            raise DamagedFileError(self.file(REWRITE_MANIFEST, staged=True), "not valid JSON") from None

    def part_schema(self, part: PartFile) -> pa.Schema:
        return read_part_schema(part)

    def run_part_schemas(self) -> dict[PartFile, pa.Schema]:
        return {part: self.part_schema(part) for part in self.run_parts()}

    def foreign_names(self) -> list[str]:
        """Entries batchgen did not write (hidden ones aside). Its names are not enough: a part is batchgen's when
        it carries a fingerprint, _SUCCESS when it holds batchgen's summary, a side file when it has its mark. A
        part whose footer cannot be read is neither: DamagedFileError."""
        files = self.listing()
        names = [name for name in sorted(files) if not name.startswith(".") and name not in self.ignored]
        unknown = [name for name in names if not self._known(name)]
        return unknown or self._unmarked(names, files)

    def carries_fingerprint(self, name: str) -> bool:
        return not self._unmarked([name], self.listing())

    def _known(self, name: str) -> bool:
        return name in (SUCCESS, *SIDE_FILE_MARKS, *self.markers) or self.is_part_name(name)

    def _unmarked(self, names: list[str], files: dict[str, PartFile]) -> list[str]:
        """Those of `names` (batchgen's by name) that are not batchgen's by content; _SUCCESS read at most once."""
        read: list[dict] = []

        def summary() -> dict:
            if not read:
                read.append(self.success() or {})
            return read[0]

        unmarked = []
        for name in names:
            if name in self.markers:
                ours = True
            elif name == SUCCESS:
                ours = "fingerprint" in summary()
            elif name in SIDE_FILE_MARKS:
                ours = is_side_file(name, self.read_text(name))
            elif name.endswith(".jsonl"):  # JSON lines carry no footer: batchgen's when its _SUCCESS names them
                ours = name in summary().get("parts", [])
            else:
                ours = FINGERPRINT_KEY in (self.part_schema(files[name]).metadata or {})
            if not ours:
                unmarked.append(name)
        return unmarked

    # -- the ledger ---------------------------------------------------------------------------------------------

    def ledger(self, total_rows: int) -> tuple[bytearray, list[PartFile], list[PartFile]]:
        """(done[row] for every committed input row, the run parts counted, the parts superseded). Every run part
        is read whole, so that a damaged one is found now (DamagedFileError) rather than by the final rewrite. A
        part holding a row an earlier part holds is superseded, left unread and deleted by the final rewrite: one
        written by an object-store run that had lost its lease (a directory's flock never lets that happen)."""
        done = bytearray(total_rows)
        marks = np.frombuffer(done, dtype=np.uint8)
        counted, superseded = [], []
        for part in self.run_parts():
            rows = run_part_rows(part)
            if rows.size and (rows.min() < 0 or rows.max() >= total_rows):
                raise DamagedFileError(part, f"its {ROW_COLUMN} column names rows outside the input's {total_rows}")
            if rows.size and marks[rows].any():
                superseded.append(part)
                continue
            marks[rows] = 1
            counted.append(part)
        self._ledger = (counted, superseded)
        return done, counted, superseded

    def ledger_parts(self, total_rows: int) -> tuple[list[PartFile], list[PartFile]]:
        """(counted, superseded) run parts: as read when the run took the output plus the parts it wrote since."""
        return self._ledger if self._ledger is not None else self.ledger(total_rows)[1:]

    def done_rows(self, total_rows: int) -> bytearray:
        """The ledger: done[row] is 1 for every input row already committed."""
        return self.ledger(total_rows)[0]

    def next_seq(self) -> int:
        return max((int(self.run_part.fullmatch(p.name)[1]) for p in self.run_parts()), default=-1) + 1

    def write_run_part(self, table: pa.Table, seq: int) -> None:
        part = self.write(self.run_part_name(seq), table, row_group_size=RUN_PART_ROW_GROUP, create=True)
        if self._ledger is not None:
            self._ledger[0].append(part)

    def remove_outputs(self) -> None:
        """--overwrite: remove what batchgen wrote (never foreign entries, nor the lock)."""
        files = self.listing()
        known = [name for name in sorted(files) if self._known(name) and name != self.lock_name]
        for name in [n for n in known if n not in self._unmarked(known, files)]:  # all decided first: _SUCCESS
            self.delete(name)                                                       # names the JSON lines parts
        self._ledger = None
        self.reset_scratch()
