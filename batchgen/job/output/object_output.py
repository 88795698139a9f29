"""An output in object storage, `output.path: s3://bucket/prefix`: the local output's guarantees (every row exactly
once, `_SUCCESS` only over a whole output, one run writing at a time) where there is no rename. The argument is in
docs/architecture.md ("Exactly once in object storage"); in short:

    run-<seq>-<run id>.parquet   run parts: unique names, written once (create-only), never changed; the ledger is
                                 their listing (a PUT is atomic: an object is whole or absent)
    _LEASE                       the output's lock (lease.py): one run writes at a time; a killed run's goes stale
    part-00000.parquet ...       the final rewrite's parts, written while the run parts stay
    _timeline.json               the runs' samples over time (job/timeline.py), rewritten as parts commit
    _report.html                 the job report, before the manifest
    _PLAN.json                   the rewrite's manifest, once every final part is written: what to delete, the summary
    _SUCCESS                     last, after the run parts are deleted: the marker readers wait for; it names the parts

A run that finds `_PLAN.json` applies it again (every step repeats safely); one that finds final parts without it
(killed mid-rewrite) writes them again. A run part written by a run that had lost its lease may repeat rows of
another: the ledger keeps the first part holding a row (in the order of the parts' names) and leaves the other
unread, so no row counts twice; the final rewrite deletes it.

`open_output` and `check_output_at` are where a job's output is one or the other kind: the local OutputDir (sink.py,
resume.py) is unchanged."""
from __future__ import annotations

import json
import uuid
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.object_store import (RemoteFile, StorageConfig, is_not_found, is_remote, list_objects, make_store,
                                   split_url, store_error)

from .final_formats import FinalFormat
from .final_rewrite import FinalReport, RowTotals, ordered_tables, report_html
from .lease import LEASE, Lease, busy_message, holder_is_gone, read_lease
from .object_location import check_object_location
from .resume import check_output, check_run_parts, refuse_changes, stored_fingerprint
from .schema import ROW_COLUMN
from .sink import (FINAL_PART, FINGERPRINT_KEY, OBJECT_RUN_PART, REPORT, REWRITE_MANIFEST, RUN_PART_ROW_GROUP,
                   SIDE_FILE_MARKS, SUCCESS, DamagedFileError, OutputDir, is_side_file, read_part, read_part_schema,
                   run_part_rows)
from ..config import JobConfigError
from ..missing_bucket import bucket_must_exist


class ObjectOutput:
    """`output.path` in object storage, and what earlier runs left there."""

    def __init__(self, url: str, storage: StorageConfig) -> None:
        self.path = self.url = url.rstrip("/")
        scheme, bucket, key = split_url(self.url)
        self.root, self.prefix = f"{scheme}{bucket}/", key + "/" if key else ""
        self.store = make_store(self.url, storage)
        self.lease_ttl_s = storage.lease_ttl_s
        self.run_id = uuid.uuid4().hex[:12]
        self.lease: Lease | None = None
        self._ledger: tuple[list[RemoteFile], list[RemoteFile]] | None = None  # (counted, superseded) run parts
        self._schemas: dict[tuple[str, str | None], pa.Schema] = {}  # part footers read, by (URL, ETag)

    # -- what is there ----------------------------------------------------------------------------------------

    def listing(self) -> dict[str, RemoteFile]:
        """Every object under the prefix by its name below it (hidden names aside, as in a local directory)."""
        try:
            metas = list_objects(self.store, self.prefix)
        except Exception as exc:
            raise store_error(exc, self.url) from None
        found = {meta["path"][len(self.prefix):]: RemoteFile(self.root + meta["path"], meta["size"], meta.get("e_tag"),
                                                              self.store, meta["last_modified"].timestamp())
                 for meta in metas}
        return {name: file for name, file in found.items() if not name.startswith(".")}

    def names(self) -> list[str]:
        return sorted(self.listing())

    def run_parts(self) -> list[RemoteFile]:
        """In the order of their sequence numbers (completion order), then run ids."""
        parts = [(OBJECT_RUN_PART.fullmatch(name), file) for name, file in self.listing().items()]
        return [file for match, file in sorted((p for p in parts if p[0]), key=lambda p: (int(p[0][1]), p[0][2]))]

    def final_parts(self) -> list[RemoteFile]:
        return [file for name, file in sorted(self.listing().items()) if FINAL_PART.fullmatch(name)]

    def foreign_names(self) -> list[str]:
        """Objects batchgen did not write: other names (or names below a `/`), parts without a fingerprint, a
        _SUCCESS without batchgen's summary."""
        listing = self.listing()
        unknown = [n for n in listing if n not in (SUCCESS, REWRITE_MANIFEST, LEASE, *SIDE_FILE_MARKS)
                   and not (OBJECT_RUN_PART.fullmatch(n) or FINAL_PART.fullmatch(n))]
        if unknown:
            return sorted(unknown)
        parts = [n for n in listing if n not in (SUCCESS, REWRITE_MANIFEST, LEASE, *SIDE_FILE_MARKS)]
        listed = (self.success() or {}).get("parts", []) if any(n.endswith(".jsonl") for n in parts) else []
        foreign = [n for n in parts if (n not in listed if n.endswith(".jsonl")  # JSON lines: named by _SUCCESS
                                        else FINGERPRINT_KEY not in (self.part_schema(listing[n]).metadata or {}))]
        if SUCCESS in listing and "fingerprint" not in (self.success() or {}):
            foreign.append(SUCCESS)
        foreign += [n for n in SIDE_FILE_MARKS if n in listing and not is_side_file(n, self.read_text(n))]
        return sorted(foreign)

    def _get(self, name: str) -> bytes | None:
        import obstore

        try:
            return bytes(obstore.get(self.store, self.prefix + name).bytes())
        except Exception as exc:
            if is_not_found(exc):
                return None
            raise store_error(exc, self.root + self.prefix + name) from None

    def read_text(self, name: str) -> str | None:
        data = self._get(name)
        try:
            return data.decode() if data is not None else None
        except UnicodeDecodeError:
            return None

    def write_text(self, name: str, text: str) -> None:
        self.put(name, text.encode())

    def success(self) -> dict | None:
        data = self._get(SUCCESS)
        try:
            summary = json.loads(data) if data is not None else None
        except ValueError:
            return None
        return summary if isinstance(summary, dict) else None

    def pending_rewrite(self) -> dict | None:
        data = self._get(REWRITE_MANIFEST)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            raise DamagedFileError(self.listing()[REWRITE_MANIFEST], "not valid JSON") from None

    def part_schema(self, part: RemoteFile) -> pa.Schema:
        """A part's schema from its footer, read once per version of the object: a run is checked before and
        again after it takes the lease, and each check reads every part's footer."""
        key = (part.url, part.etag)
        if key not in self._schemas:
            self._schemas[key] = read_part_schema(part)
        return self._schemas[key]

    def run_part_schemas(self) -> dict[RemoteFile, pa.Schema]:
        return {part: self.part_schema(part) for part in self.run_parts()}

    def ledger(self, total_rows: int) -> tuple[bytearray, list[RemoteFile], list[RemoteFile]]:
        """(done[row] for every committed input row, the run parts counted, the parts superseded: holding a row an
        earlier part holds, written by a run that had lost its lease)."""
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

    def ledger_parts(self, total_rows: int) -> tuple[list[RemoteFile], list[RemoteFile]]:
        """(counted, superseded) run parts: as read when the run took the output plus the parts it wrote since."""
        return self._ledger if self._ledger is not None else self.ledger(total_rows)[1:]

    def done_rows(self, total_rows: int) -> bytearray:
        return self.ledger(total_rows)[0]

    def next_seq(self) -> int:
        return max((int(OBJECT_RUN_PART.fullmatch(p.name)[1]) for p in self.run_parts()), default=-1) + 1

    # -- writing (each write checks the lease first) ----------------------------------------------------------

    def take_lease(self) -> None:
        self.lease = Lease(self.store, self.prefix + LEASE, self.root + self.prefix + LEASE, self.lease_ttl_s,
                           self.run_id)
        self.lease.acquire(self.url)

    def release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def _check_lease(self) -> None:
        if self.lease is None:
            raise RuntimeError("internal error: a write to an object-store output without its lease")
        self.lease.check()

    def put(self, name: str, data: bytes, create: bool = False) -> RemoteFile:
        import obstore

        self._check_lease()
        key = self.prefix + name
        try:
            meta = obstore.put(self.store, key, data, mode="create" if create else "overwrite")
        except Exception as exc:
            raise store_error(exc, self.root + key) from None
        return RemoteFile(self.root + key, len(data), meta.get("e_tag"), self.store)

    def delete(self, name: str) -> None:
        import obstore

        self._check_lease()
        try:
            obstore.delete(self.store, self.prefix + name)
        except Exception as exc:
            if not is_not_found(exc):
                raise store_error(exc, self.root + self.prefix + name) from None

    def write_run_part(self, table: pa.Table, seq: int) -> None:
        part = self.put(f"run-{seq:05d}-{self.run_id}.parquet", parquet_bytes(table, RUN_PART_ROW_GROUP),
                        create=True)
        if self._ledger is not None:
            self._ledger[0].append(part)

    def remove_outputs(self) -> None:
        """--overwrite: delete what batchgen wrote (foreign_names refused anything else before)."""
        for name in self.names():
            if name != LEASE:
                self.delete(name)
        self._ledger = None


def parquet_bytes(table: pa.Table, row_group_size: int | None = None) -> bytes:
    stream = pa.BufferOutputStream()
    pq.write_table(table, stream, row_group_size=row_group_size, write_page_checksum=True)
    return stream.getvalue().to_pybytes()  # obstore takes bytes, not an Arrow buffer


def open_output(path: str, storage: StorageConfig) -> OutputDir | ObjectOutput:
    return ObjectOutput(path, storage) if is_remote(path) else OutputDir(path)


def check_output_at(out: OutputDir | ObjectOutput, fingerprint: dict[str, Any], overwrite: bool,
                    run_schema: pa.Schema | None = None) -> dict | None:
    """resume.check_output's refusals, for either kind of output: the _SUCCESS summary when this job finished."""
    if isinstance(out, OutputDir):
        return check_output(out, fingerprint, overwrite, run_schema)
    with bucket_must_exist("output.path", out.url):
        return _check_objects(out, fingerprint, overwrite, run_schema)


def _check_objects(out: ObjectOutput, fingerprint: dict[str, Any], overwrite: bool,
                   run_schema: pa.Schema | None) -> dict | None:
    where = f"output.path: {out.url}"
    check_object_location(out, out.listing())
    foreign = out.foreign_names()
    if foreign:
        raise JobConfigError(f"{where} holds objects batchgen did not write ({', '.join(foreign[:3])}); "
                             f"choose another output.path")
    if overwrite:
        return None
    rewrite, success = out.pending_rewrite(), out.success()
    if rewrite is not None or success is not None:
        refuse_changes(where, ((rewrite or {}).get("success") or success).get("fingerprint", {}), fingerprint)
        return success if rewrite is None else None
    for part in out.final_parts():  # a killed rewrite's: written again by this run, but only for the same job
        refuse_changes(where, stored_fingerprint(out.part_schema(part)), fingerprint)
    check_run_parts(where, out.run_part_schemas(), fingerprint, run_schema)
    return None


def live_holder(out: ObjectOutput) -> dict | None:
    """The lease's holder (lease.read_lease) if a run would find it live: fresh, and its holder not gone."""
    holder = read_lease(out.store, out.prefix + LEASE, out.root + out.prefix + LEASE)
    if holder is None or holder["age_s"] >= holder["ttl_s"] or holder_is_gone(holder):
        return None
    return holder


def live_lease(out: ObjectOutput) -> str | None:
    """For `batchgen plan`: the message run would stop with if a live lease is there (None otherwise)."""
    holder = live_holder(out)
    return None if holder is None else busy_message(out.url, holder)


def finalize_objects(out: ObjectOutput, schema: pa.Schema, total_rows: int, order: str, rows_per_part: int,
                     summary: Callable[[RowTotals], dict], report: FinalReport | None = None,
                     fmt: FinalFormat = FinalFormat()) -> dict:
    """final_rewrite.finalize in object storage: the final parts written over any a killed rewrite left, the
    report, then the manifest, then apply_object_rewrite."""
    counted, superseded = out.ledger_parts(total_rows)
    stale = [part.name for part in out.final_parts()]
    tables = ordered_tables(counted, total_rows, rows_per_part) if order == "input" \
        else (read_part(p) for p in counted)
    totals, names = RowTotals(), []
    for index, table in enumerate(tables):
        totals.add(table)
        if report is not None:
            report.add(table)
        for name, content in fmt.files(table.drop_columns([ROW_COLUMN]).cast(schema), index):
            out.put(name, parquet_bytes(content) if isinstance(content, pa.Table) else content.encode())
            names.append(name)
    if not names:
        for name, content in fmt.empty(schema):
            out.put(name, parquet_bytes(content) if isinstance(content, pa.Table) else content.encode())
            names.append(name)
    if totals.rows != total_rows:
        raise RuntimeError(f"internal error: {totals.rows} rows committed for {total_rows} input rows")
    for name in stale:  # a killed rewrite's parts beyond this one's
        if name not in names:
            out.delete(name)
    success = summary(totals)
    page = report_html(report, success)
    if page is not None:
        out.put(REPORT, page.encode())
    manifest = {"remove": [p.name for p in counted + superseded], "add": names, "success": success}
    out.put(REWRITE_MANIFEST, json.dumps(manifest).encode())
    return apply_object_rewrite(out)


def apply_object_rewrite(out: ObjectOutput) -> dict:
    """Delete the run parts, write _SUCCESS (naming the final parts), delete the manifest: each step repeats safely."""
    manifest = out.pending_rewrite()
    for name in manifest["remove"]:
        out.delete(name)
    success = {**manifest["success"], "parts": manifest["add"]}
    out.put(SUCCESS, (json.dumps(success, indent=2) + "\n").encode())
    out.delete(REWRITE_MANIFEST)
    return success
