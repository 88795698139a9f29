"""The lease on an object-store output: one run writes a prefix at a time, and a killed run does not block the next
one forever. It stands where a local output has its flock (output_dir.lock_output), which dies with its process; an
object store has no such lock, and no rename, so the lease is an object, `_LEASE`, written only conditionally:

- taken with a create-only write (If-None-Match: *): of two runs starting at once, one gets it;
- refreshed by its holder every ttl/3 with a write conditioned on the ETag it last wrote (If-Match): a holder whose
  lease was taken over finds out at its next refresh;
- taken over only once stale (not refreshed for its ttl, by the store's Last-Modified against this machine's
  clock), or at once where its holder provably no longer runs (this host and pid namespace, and its pid gone or now
  another process's: `holder_is_gone`), with If-Match on the version read: of two runs taking it over at once,
  exactly one wins. A live lease is OutputBusy (exit 75: retry later).

Its holder checks it before every write (`check`): a lease not refreshed within its ttl (the store unreachable, the
process stalled) may already be another run's, so the holder stops writing (LeaseLost, exit 1; its committed parts
stay, and the ledger keeps a part written by a holder that lost the race from counting twice: store.py).
The lease holds the run's id, host, pid, the pid's start time and pid namespace, never a credential. A run that
ends (done or failed) deletes it if the store still holds the version it last wrote."""
from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from datetime import datetime, timezone
from typing import Any

from batchgen.object_store import is_not_found, store_error

from ..keys import OutputBusy

log = logging.getLogger(__name__)
LEASE = "_LEASE"


class LeaseLost(Exception):
    """This run can no longer be sure it is the only one writing the output: it stops (exit 1)."""


class Lease:
    def __init__(self, store: Any, key: str, url: str, ttl_s: float, run_id: str) -> None:
        self.store, self.key, self.url, self.ttl_s, self.run_id = store, key, url, ttl_s, run_id
        self.etag: str | None = None
        self.refreshed_at = 0.0  # time.monotonic() when the last successful write was sent
        self.lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"run_id": self.run_id, **this_process(), "ttl_s": self.ttl_s,
                           "refreshed_at": datetime.now(timezone.utc).isoformat()}).encode()

    def acquire(self, output: str) -> None:
        """Take the lease, or take over a stale one or one whose holder is gone; a live one is another run's:
        OutputBusy (exit 75)."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        for _ in range(5):
            sent = time.monotonic()
            try:
                self.etag = obstore.put(self.store, self.key, self._body(), mode="create")["e_tag"]
                break
            except AlreadyExistsError:
                pass
            except Exception as exc:
                raise store_error(exc, self.url) from None
            holder = read_lease(self.store, self.key, self.url)
            if holder is None:
                continue  # released meanwhile: try to create it again
            stale, gone = holder["age_s"] >= holder["ttl_s"], holder_is_gone(holder)
            if not stale and not gone:
                raise OutputBusy(busy_message(output, holder))
            sent = time.monotonic()
            try:
                self.etag = obstore.put(self.store, self.key, self._body(), mode={"e_tag": holder["etag"]})["e_tag"]
            except PreconditionError:
                continue  # another run took it over (or its holder refreshed it) first: look again
            except Exception as exc:
                raise store_error(exc, self.url) from None
            log.info("took over the %s on %s (%s)", "stale lease" if stale else "lease of a run that is gone",
                     output, holder_text(holder))
            break
        else:
            raise OutputBusy(f"output.path: another batchgen run is taking {output} (its lease {self.url} keeps "
                             f"changing hands); retry later")
        self.refreshed_at = sent
        self._thread = threading.Thread(target=self._refresh_loop, name="batchgen-lease", daemon=True)
        self._thread.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self.refresh()

    def refresh(self) -> None:
        import obstore
        from obstore.exceptions import PreconditionError

        with self._lock:
            if self.lost is not None or self.etag is None:
                return
            sent = time.monotonic()
            try:
                self.etag = obstore.put(self.store, self.key, self._body(), mode={"e_tag": self.etag})["e_tag"]
                self.refreshed_at = sent
            except PreconditionError:
                self.lost = "another run took it over"
            except Exception as exc:
                if time.monotonic() - self.refreshed_at >= self.ttl_s:
                    self.lost = f"not refreshed for its ttl of {self.ttl_s:g} s: {store_error(exc, self.url)}"
                elif is_not_found(exc):
                    self.lost = "it was deleted"

    def check(self) -> None:
        """Before a write: the lease is still this run's, with at least half its ttl to go (refreshed now if not)."""
        if self.lost is None and time.monotonic() - self.refreshed_at > self.ttl_s / 2:
            self.refresh()
        if self.lost is None and time.monotonic() - self.refreshed_at >= self.ttl_s:
            self.lost = f"not refreshed for its ttl of {self.ttl_s:g} s"
        if self.lost is not None:
            raise LeaseLost(f"{self.url}: this run lost its lease on the output ({self.lost}), so it stops writing")

    def release(self) -> None:
        """Stop refreshing and delete the lease if the store still holds the version this run last wrote, also when
        the run stopped for not refreshing it in time (a store that stalled and came back): an ETag still this run's
        means no run took it over. A lease not deleted goes stale, or is taken over at once on this host."""
        import obstore

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.etag is None:
                return
            try:
                if obstore.head(self.store, self.key).get("e_tag") == self.etag:
                    obstore.delete(self.store, self.key)
            except Exception:
                pass  # unreachable: the lease goes stale by itself
            self.etag = None


def read_lease(store: Any, key: str, url: str) -> dict | None:
    """The lease object there: its holder, ETag, age by the store's clock and ttl; None when there is none."""
    import obstore

    try:
        got = obstore.get(store, key)
        body, meta = bytes(got.bytes()), got.meta
    except Exception as exc:
        if is_not_found(exc):
            return None
        raise store_error(exc, url) from None
    try:
        holder = json.loads(body)
        holder = holder if isinstance(holder, dict) else {}
    except ValueError:
        holder = {}
    ttl = holder.get("ttl_s")
    age = (datetime.now(timezone.utc) - meta["last_modified"]).total_seconds()
    return {**holder, "etag": meta.get("e_tag"), "age_s": max(age, 0.0),
            "ttl_s": float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else 60.0}


def holder_text(holder: dict) -> str:
    return (f"run {holder.get('run_id', '?')} on host {holder.get('host', '?')} (pid {holder.get('pid', '?')}), "
            f"lease refreshed {holder['age_s']:.0f} s ago")


def busy_message(output: str, holder: dict) -> str:
    """Why a run cannot write `output` now, and how long to wait."""
    if on_this_host(holder):
        wait = (f"pid {holder.get('pid')} is alive on this host: retry once it has finished (a re-run takes over as "
                f"soon as it is gone)")
    else:
        wait = (f"retry once it has finished; if it was killed, its lease goes stale "
                f"{holder['ttl_s'] - holder['age_s']:.0f} s from now and a re-run takes over then")
    return f"output.path: another batchgen run is writing {output} ({holder_text(holder)}); {wait}"


@functools.lru_cache(maxsize=1)
def this_process() -> dict:
    """What names this process in a lease: its host, its pid, the pid's start time (pids are reused) and its pid
    namespace (two containers can share a host name and see different pids)."""
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": psutil.Process().create_time(),
            "pid_ns": _pid_namespace()}


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def on_this_host(holder: dict) -> bool:
    """Whether the holder's pid names a process this one can see: same host name and pid namespace."""
    here = this_process()
    return holder.get("host") == here["host"] and here["pid_ns"] is not None and holder.get("pid_ns") == here["pid_ns"]


def holder_is_gone(holder: dict) -> bool:
    """Whether the lease's holder provably no longer runs: it ran where this process can see its pid, and that pid
    is gone, a zombie, or a process started at another time (the pid reused). Anywhere else it may be alive."""
    import psutil

    pid, started = holder.get("pid"), holder.get("pid_started")
    if not on_this_host(holder) or not isinstance(pid, int) or not isinstance(started, (int, float)):
        return False
    try:
        process = psutil.Process(pid)
        return process.status() == psutil.STATUS_ZOMBIE or abs(process.create_time() - started) > 1.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # not ours to inspect: it exists
        return False
