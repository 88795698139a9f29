"""What a resume must match: the one output check, for either kind of store (store.py). The fingerprint
(prepare.job_fingerprint) holds everything that decides the rows' results, the identity of every input file
included; `check_output` compares it with what the output holds and refuses, naming what changed, when they
differ."""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Iterator

import pyarrow as pa

from batchgen.object_store import RemoteFile

from ..config import JobConfigError
from ..input.parquet_read import InputFile
from ..missing_bucket import bucket_must_exist
from .parts import FINGERPRINT_KEY, OBJECT_RUN_PART, RUN_PART, DamagedFileError
from .store import OutputStore

# The Parquet tail: a 4-byte little-endian footer length, then the magic bytes.
_TAIL = 8
_TEXT_TAIL = 1 << 20  # a text input's identity hashes its last MiB


def input_identity(path: InputFile) -> dict[str, Any]:
    """What makes an input file the same file for a resume: its size, modification time and a hash of its Parquet
    footer (schema, row groups, column statistics), which changes with the content without reading the data; a
    text file's, of its last bytes. An object's: its size and ETag (a rewritten object gets a new one)."""
    if isinstance(path, RemoteFile):
        return path.identity()
    try:
        stat = path.stat()
        with open(path, "rb") as file:
            file.seek(max(stat.st_size - _TAIL, 0))
            tail = file.read(_TAIL)
            length = min(int.from_bytes(tail[:4], "little"), max(stat.st_size - _TAIL, 0)) \
                if tail.endswith(b"PAR1") else min(stat.st_size, _TEXT_TAIL) - _TAIL
            file.seek(max(stat.st_size - _TAIL - length, 0))
            footer = file.read(length + _TAIL)
    except OSError as exc:
        raise JobConfigError(f"input.path: cannot read {path}: {exc.strerror or exc}") from None
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "footer_sha256": hashlib.sha256(footer).hexdigest()}


def check_output(out: OutputStore, fingerprint: dict[str, Any], overwrite: bool,
                 run_schema: pa.Schema | None = None) -> dict | None:
    """Refuse an output where batchgen may not write (check_location), holding someone else's files or another
    job's rows (unless --overwrite); return the _SUCCESS summary when this very job already finished. `run_schema`,
    when given, is what the run parts must hold (columns and types), so that the final rewrite cannot fail on
    them. A missing bucket is the job's error, naming output.path."""
    with bucket_must_exist("output.path", str(out.path)):
        return _check(out, f"output.path: {out.path}", fingerprint, overwrite, run_schema)


def _check(out: OutputStore, where: str, fingerprint: dict[str, Any], overwrite: bool,
           run_schema: pa.Schema | None) -> dict | None:
    out.check_location()
    foreign = out.foreign_names()
    if foreign:
        raise JobConfigError(f"{where} holds {out.noun} batchgen did not write ({', '.join(foreign[:3])}); "
                             f"choose another output.path")
    if overwrite:
        return None
    rewrite = out.pending_rewrite()
    success = out.success()
    if rewrite is not None or success is not None:
        previous = (rewrite or {}).get("success") or success
        refuse_changes(where, previous.get("fingerprint", {}), fingerprint)
        return success if rewrite is None else None
    for part in out.final_parts():
        if not out.rewrites_in_place:  # a directory's rewrite stages them: these are not a killed rewrite's
            raise JobConfigError(f"{where} holds finished parts but no _SUCCESS; re-run with --overwrite to start "
                                 f"over")
        refuse_changes(where, stored_fingerprint(out.part_schema(part)), fingerprint)  # written again by this run
    check_run_parts(where, out.run_part_schemas(), fingerprint, run_schema)
    return None


def check_run_parts(where: str, schemas: dict[Any, pa.Schema], fingerprint: dict[str, Any],
                    run_schema: pa.Schema | None) -> None:
    """Each run part (by its schema) holds this job's rows, in the columns and types it writes."""
    for part, schema in schemas.items():
        refuse_changes(where, stored_fingerprint(schema), fingerprint)
        if run_schema is not None and not schema.remove_metadata().equals(run_schema.remove_metadata()):
            raise JobConfigError(f"{where} holds {part.name} with other columns or types than this job writes; "
                                 f"re-run with --overwrite to start over")


def stored_fingerprint(schema: pa.Schema) -> dict:
    try:
        return json.loads((schema.metadata or {}).get(FINGERPRINT_KEY, b"{}"))
    except ValueError:
        return {}


def refuse_changes(where: str, previous: dict, current: dict) -> None:
    changes = describe_changes(previous, current)
    if changes:
        raise JobConfigError(f"{where} holds rows of a different job ({changes}); "
                             f"re-run with --overwrite to start over, or choose another output.path")


def describe_changes(previous: dict, current: dict) -> str:
    """What differs between two fingerprints ('' when nothing): the keys, and for the input the file and how."""
    # both sides' keys: a key present on one side only (quantization, when off) is a change too
    keys = [key for key in {**current, **previous} if key != "files" and previous.get(key) != current.get(key)]
    changes = [f"{', '.join(keys)} changed"] if keys else []
    if previous.get("files") != current.get("files"):
        changes.append(files_change(previous.get("files") or [], current.get("files") or []))
    return "; ".join(changes)


def files_change(previous: list, current: list[dict]) -> str:
    """The first input file that was added, removed or changed, and how."""
    before = {entry["path"]: entry for entry in map(_file_entry, previous)}
    for entry in current:
        old = before.pop(entry["path"], None)
        if old is None:
            return f"input file {entry['path']} is new"
        if old != entry:
            return f"input file {entry['path']} changed: {file_diff(old, entry)}"
    return f"input file {next(iter(before))} is gone" if before else "input files changed"


def _file_entry(entry: Any) -> dict:
    """An entry of the fingerprint's file list (a [path, rows] pair before the identity was recorded)."""
    return entry if isinstance(entry, dict) else {"path": entry[0], "rows": entry[1]}


def file_diff(old: dict, new: dict) -> str:
    if "size" not in old:
        return "its identity was not recorded (the output was written by an older batchgen)"
    diffs = []
    if old["rows"] != new["rows"]:
        diffs.append(f"{old['rows']} -> {new['rows']} rows")
    if old["size"] != new["size"]:
        diffs.append(f"{old['size']} -> {new['size']} bytes")
    if old.get("mtime_ns") != new.get("mtime_ns") and "mtime_ns" in old and "mtime_ns" in new:
        diffs.append(f"modified {_when(old['mtime_ns'])} -> {_when(new['mtime_ns'])}")
    if old.get("footer_sha256") != new.get("footer_sha256") and "footer_sha256" in old and "footer_sha256" in new:
        diffs.append("other Parquet footer (schema, row groups or statistics)")
    if old.get("etag") != new.get("etag"):  # an object in object storage: rewritten
        diffs.append(f"ETag {old.get('etag')} -> {new.get('etag')}")
    return ", ".join(diffs) or "its identity differs"


def _when(mtime_ns: int) -> str:
    return datetime.fromtimestamp(mtime_ns / 1e9).isoformat(sep=" ", timespec="microseconds")


@contextmanager
def output_errors(out: OutputStore) -> Iterator[None]:
    """What goes wrong with the output before the run, as job errors naming output.path."""
    try:
        yield
    except DamagedFileError as exc:
        raise JobConfigError(damaged_message(out, exc)) from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and os.fspath(exc.filename) != str(out.path) else ""
        raise JobConfigError(f"output.path: cannot write {out.path}: {exc.strerror or exc}{where}") from None


def damaged_message(out: OutputStore, exc: DamagedFileError) -> str:
    """Name the damaged file and the way out. A run part holds committed rows: without it, they are generated
    again. A file batchgen cannot read is not provably its own, so --overwrite leaves it for the user to delete."""
    if RUN_PART.fullmatch(exc.path.name) or OBJECT_RUN_PART.fullmatch(exc.path.name):
        remedy = "delete that file and re-run the same command (its rows are generated again)"
    elif out.is_staged(exc.path):
        remedy = "re-run with --overwrite to start over"
    else:
        remedy = "delete that file and re-run with --overwrite to start over"
    return f"output.path: {exc.path} is damaged: {exc.reason}; {remedy}"
