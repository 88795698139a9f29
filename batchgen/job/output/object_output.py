"""An output in object storage, `output.path: s3://bucket/prefix` (`ObjectOutput`), the output-store protocol
(store.py) where there is no rename: the local output's guarantees (every row exactly once, `_SUCCESS` only over a
whole output, one run writing at a time) from create-only PUTs, conditional writes and a lease. The argument is in
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
(killed mid-rewrite) writes them again (`rewrites_in_place`). A run part written by a run that had lost its lease may
repeat rows of another: the ledger (store.py) keeps the first part holding a row (in the order of the parts' names)
and leaves the other unread, so no row counts twice; the final rewrite deletes it."""
from __future__ import annotations

import uuid

import pyarrow as pa

from batchgen.object_store import (RemoteFile, StorageConfig, is_not_found, list_objects, make_store, split_url,
                                   store_error)

from .lease import LEASE, Lease, busy_message, holder_is_gone, holder_text, read_lease
from .object_location import check_object_location
from .parts import OBJECT_RUN_PART, REWRITE_MANIFEST, PartFile, parquet_bytes, read_part_schema
from .store import Content, OutputStore


class ObjectOutput(OutputStore):
    """`output.path` in object storage, and what earlier runs left there. Every write checks the lease first."""

    noun = "objects"
    run_part = OBJECT_RUN_PART
    markers = (REWRITE_MANIFEST, LEASE)
    lock_name = LEASE
    rewrites_in_place = True

    def __init__(self, url: str, storage: StorageConfig) -> None:
        super().__init__()
        self.path = self.url = url.rstrip("/")
        scheme, bucket, key = split_url(self.url)
        self.root, self.prefix = f"{scheme}{bucket}/", key + "/" if key else ""
        self.store = make_store(self.url, storage)
        self.lease_ttl_s = storage.lease_ttl_s
        self.run_id = uuid.uuid4().hex[:12]
        self.lease: Lease | None = None
        self._schemas: dict[tuple[str, str | None], pa.Schema] = {}  # part footers read, by (URL, ETag)

    # -- the store's primitives -------------------------------------------------------------------------------

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

    def file(self, name: str, staged: bool = False) -> PartFile:
        """Staged or not: there is no rename, so the rewrite writes where readers see (rewrites_in_place)."""
        return self.listing()[name]

    def read(self, name: str, staged: bool = False) -> bytes | None:
        import obstore

        try:
            return bytes(obstore.get(self.store, self.prefix + name).bytes())
        except Exception as exc:
            if is_not_found(exc):
                return None
            raise store_error(exc, self.root + self.prefix + name) from None

    def write(self, name: str, content: Content, row_group_size: int | None = None, create: bool = False,
              staged: bool = False) -> RemoteFile:
        """One PUT (an object is whole or absent); `create`: only if absent (If-None-Match: *)."""
        import obstore

        self._check_lease()
        data = parquet_bytes(content, row_group_size) if isinstance(content, pa.Table) \
            else content.encode() if isinstance(content, str) else content
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

    def lock(self) -> None:
        self.lease = Lease(self.store, self.prefix + LEASE, self.root + self.prefix + LEASE, self.lease_ttl_s,
                           self.run_id)
        self.lease.acquire(self.url)

    def unlock(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def _check_lease(self) -> None:
        if self.lease is None:
            raise RuntimeError("internal error: a write to an object-store output without its lease")
        self.lease.check()

    def live_holder(self) -> dict | None:
        """The lease's holder (lease.read_lease) if a run would find it live: fresh, and its holder not gone."""
        holder = read_lease(self.store, self.prefix + LEASE, self.root + self.prefix + LEASE)
        if holder is None or holder["age_s"] >= holder["ttl_s"] or holder_is_gone(holder):
            return None
        return holder

    def holder(self) -> str | None:
        holder = self.live_holder()
        return None if holder is None else holder_text(holder)

    def busy_message(self) -> str | None:
        """The message run would stop with if a live lease is there."""
        holder = self.live_holder()
        return None if holder is None else busy_message(self.url, holder)

    def check_location(self) -> None:
        check_object_location(self, self.listing())

    def run_part_name(self, seq: int) -> str:
        return f"run-{seq:05d}-{self.run_id}.parquet"

    def commit_time(self, part: PartFile) -> float:
        return part.modified

    def begin_rewrite(self) -> None:
        pass  # the final parts are written over any a killed rewrite left (final_rewrite deletes those beyond)

    def publish(self, names: list[str]) -> None:
        pass  # written where readers see them already

    def end_rewrite(self) -> None:
        self.delete(REWRITE_MANIFEST)

    def is_staged(self, part: PartFile) -> bool:
        return False

    def discard_scratch(self) -> None:
        pass  # nothing is kept beside the output

    def reset_scratch(self) -> None:
        pass

    # -- read once per object ---------------------------------------------------------------------------------

    def part_schema(self, part: PartFile) -> pa.Schema:
        """A part's schema from its footer, read once per version of the object: a run is checked before and
        again after it takes the lease, and each check reads every part's footer."""
        key = (part.url, part.etag)
        if key not in self._schemas:
            self._schemas[key] = read_part_schema(part)
        return self._schemas[key]
