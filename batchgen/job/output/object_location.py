"""Where an object-store output may be: never inside another job's output, nor holding one — as on disk
(OutputDir.check_location), since a reader of the outer prefix reads the inner one's objects too, and each job would
take the other's objects for its own or for foreign ones. A prefix is a batchgen output when it holds one of its
markers: the lease, the rewrite's manifest, _SUCCESS or the timeline (each run writes it from its first commit on),
each checked by its content (a Spark job writes _SUCCESS too); or, below an output, a run part or a final part
carrying batchgen's fingerprint.

The cost: up to four small GETs per prefix above the output (absent objects, usually), and the listing of the
output's own prefix that its checks read anyway."""
from __future__ import annotations

import json
from typing import Any, Protocol

from batchgen.object_store import RemoteFile, is_not_found, store_error

from ..keys import JobConfigError
from .lease import LEASE
from .parts import (FINAL_PART, FINGERPRINT_KEY, OBJECT_RUN_PART, REWRITE_MANIFEST, SUCCESS, TIMELINE,
                    DamagedFileError, is_side_file, read_part_schema)


class ObjectPrefix(Protocol):
    """Where an object-store output is (object_output.ObjectOutput is one): its URL, the bucket's root URL, its
    key prefix below it ('' or ending in '/') and the store to ask."""

    url: str
    root: str
    prefix: str
    store: Any


MARKERS = (LEASE, REWRITE_MANIFEST, SUCCESS, TIMELINE)
_MARK_BYTES = 4096  # is_side_file looks at a side file's start


def check_object_location(out: ObjectPrefix, listing: dict[str, RemoteFile]) -> None:
    """Refuse an output inside another job's output, or holding one (found in `listing`, the output's own)."""
    where = f"output.path: {out.url}"
    enclosing = enclosing_output(out)
    if enclosing is not None:
        raise JobConfigError(f"{where} is inside {enclosing}, another batchgen job's output (its readers would read "
                             f"these rows too); choose an output.path outside it")
    nested = nested_output(out, listing)
    if nested is not None:
        raise JobConfigError(f"{where} holds {nested}, another batchgen job's output (readers of this output "
                             f"would read its rows too); choose another output.path")


def enclosing_output(out: ObjectPrefix) -> str | None:
    """The nearest prefix above the output (the bucket's root included) that holds a batchgen output."""
    folders = out.prefix.rstrip("/").split("/") if out.prefix else []
    for depth in range(len(folders) - 1, -1, -1):
        prefix = "".join(folder + "/" for folder in folders[:depth])
        if any(_holds_marker(out, prefix + name) for name in MARKERS):
            return (out.root + prefix).rstrip("/")
    return None


def nested_output(out: ObjectPrefix, listing: dict[str, RemoteFile]) -> str | None:
    """The first sub-prefix of the output that holds a batchgen output, by the objects listed under it."""
    final_parts_read: set[str] = set()  # one footer per sub-prefix: a foreign dataset's parts are not all read
    for name, file in sorted(listing.items()):
        folder, _, leaf = name.rpartition("/")
        if not folder:
            continue
        if OBJECT_RUN_PART.fullmatch(leaf) or leaf in MARKERS and _holds_marker(out, out.prefix + name):
            return f"{out.url}/{folder}"
        if FINAL_PART.fullmatch(leaf) and leaf.endswith(".parquet") and folder not in final_parts_read:
            final_parts_read.add(folder)
            if _carries_fingerprint(file):
                return f"{out.url}/{folder}"
    return None


def _holds_marker(out: ObjectPrefix, key: str) -> bool:
    """Whether the object at `key` is the batchgen marker its name says (absent: False)."""
    import obstore

    name = key.rpartition("/")[2]
    try:
        data = bytes(obstore.get(out.store, key, options={"range": (0, _MARK_BYTES)} if name == TIMELINE else None)
                     .bytes())
    except Exception as exc:
        if is_not_found(exc):
            return False
        raise store_error(exc, out.root + key) from None
    if name == TIMELINE:
        return is_side_file(TIMELINE, data.decode("utf-8", "replace"))
    try:
        content = json.loads(data)
    except ValueError:
        return False
    required = {LEASE: "run_id", REWRITE_MANIFEST: "success", SUCCESS: "fingerprint"}[name]
    return isinstance(content, dict) and required in content


def _carries_fingerprint(part: RemoteFile) -> bool:
    try:
        return FINGERPRINT_KEY in (read_part_schema(part).metadata or {})
    except DamagedFileError:
        return False
