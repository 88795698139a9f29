"""`batchgen status OUTPUT`: what a job has committed to its output, for another shell or a pipeline step, read from
the output alone (the ledger's part footers, `_SUCCESS`, the lock or lease) without taking the lock or touching
the run: rows done of the total, whether a run is writing it, the rate over its last commits and an ETA."""
from __future__ import annotations

import json
from typing import Any

from batchgen.object_store import StorageConfig

from .config import JobConfigError
from .missing_bucket import bucket_must_exist
from .output.open_output import open_output
from .output.parts import FINGERPRINT_KEY, part_metadata
from .output.store import OutputStore

RATE_COMMITS = 10  # the rate is measured over the last this many commits


def output_status(path: str, storage: StorageConfig = StorageConfig()) -> dict[str, Any]:
    """{state: finished | running | finishing | stopped, rows_done, rows_total, rows_per_s, eta_s, holder, ...}."""
    with bucket_must_exist("output", path):
        return _status(open_output(path, storage), path)


def _status(out: OutputStore, path: str) -> dict[str, Any]:
    success = out.success()
    if success is not None and "fingerprint" in success:
        return {"output": str(out.path), "state": "finished", "rows_done": success.get("rows"),
                "rows_total": success.get("rows"), "wall_s": success.get("wall_s"),
                "finished_at": success.get("finished_at"), "holder": None, "rows_per_s": None, "eta_s": None}
    foreign = out.foreign_names() if out.pending_rewrite() is None else []  # a rewrite's JSON-lines parts: its own
    if foreign:
        raise JobConfigError(f"output: {path} holds files batchgen did not write ({', '.join(foreign[:3])}): it is "
                             f"not a batchgen output")
    holder = out.holder()
    commits = sorted(((out.commit_time(part), part) for part in out.run_parts()), key=lambda commit: commit[0])
    if not commits and holder is None and out.pending_rewrite() is None:
        raise JobConfigError(f"output: {path} holds no batchgen output (no run parts, no _SUCCESS, no run writing it)")
    fingerprint, n = {}, 1
    rows = []
    for _, part in commits:
        metadata = part_metadata(part)
        if not fingerprint:
            fingerprint = json.loads((metadata.metadata or {}).get(FINGERPRINT_KEY, b"{}"))
            n = max(int((fingerprint.get("sampling") or {}).get("n") or 1), 1)
        rows.append(metadata.num_rows // n)  # a row's n samples are committed together
    total = sum(entry.get("rows", 0) for entry in fingerprint.get("files", [])) if fingerprint else None
    recent = commits[-RATE_COMMITS:]
    span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
    rate = sum(rows[-len(recent) + 1:]) / span if span > 0 else None
    done = sum(rows)
    state = "finishing" if out.pending_rewrite() is not None else "running" if holder is not None else "stopped"
    return {"output": str(out.path), "state": state, "rows_done": done, "rows_total": total, "holder": holder,
            "rows_per_s": rate, "eta_s": (total - done) / rate if rate and total is not None else None,
            "last_commit_at": recent[-1][0] if recent else None}


def format_status(status: dict[str, Any]) -> str:
    from .progress_log import eta_text

    done, total = status["rows_done"], status["rows_total"]
    share = f" ({100.0 * done / total:.1f}%)" if total else ""
    line = f"{status['output']}: {status['state']}, {done:,} of {total:,} rows committed{share}" if total is not None \
        else f"{status['output']}: {status['state']}, nothing committed yet"
    if status["state"] == "finished":
        return f"{line}; finished at {status['finished_at']} ({status['wall_s']:.1f} s)"
    if status["holder"]:
        line += f"; written by {status['holder']}"
    if status["rows_per_s"]:
        line += f"; {status['rows_per_s']:.2f} rows/s over the last commits, ETA {eta_text(status['eta_s'])}"
    if status["state"] == "stopped":
        line += "; no run is writing it: re-run the job to resume"
    return line
