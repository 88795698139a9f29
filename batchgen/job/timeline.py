"""The run's timeline: what the engines and the job did over time, sampled as the run goes, for the job report
(`_report.html`: throughput, batch size, KV use, preemptions, prefix hits and memory over the run).

A lane is one series of samples: `job` (rows committed, error rows, output tokens, as the writer sees them) and one
per engine (`engine` in a local run, `replica N` in a Ray run, from the stats each replica sends with its results).
A sample is taken at most every `interval_s` (SAMPLE_INTERVAL_S at first); a lane holds at most MAX_SAMPLES: when full, every other
sample is dropped and the lane samples half as often, so a run of any length keeps its whole span, coarser. Counters
are running sums, so dropping samples loses resolution, never totals.

Stored in the output as `_timeline.json` (TIMELINE): rewritten at most every WRITE_INTERVAL_S as parts commit, and
before the final rewrite. A resumed job keeps its earlier runs' timelines (the last MAX_RUNS), each marked with how
far it got: `running` for one that was killed."""
from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .output.parts import SIDE_FILE_MARKS, TIMELINE

FORMAT = SIDE_FILE_MARKS[TIMELINE] + "1"  # "batchgen-timeline/1"
SAMPLE_INTERVAL_S = 0.25  # at first: a lane's interval doubles each time it fills
MAX_SAMPLES = 512
MAX_RUNS = 16
WRITE_INTERVAL_S = 10.0

# (the column in a lane, the engine stats key): counters are running sums, the rest values at the sample
ENGINE_FIELDS = (("results", "num_results"), ("output_tokens", "num_sampled_tokens"), ("steps", "num_steps"),
                 ("step_seqs", "step_seqs_sum"), ("step_tokens", "step_tokens_sum"), ("running", "num_running"),
                 ("waiting", "num_waiting"), ("kv_blocks_in_use", "kv_blocks_in_use"),
                 ("preemptions", "num_preemptions"), ("prefix_queries", "prefix_cache_queries"),
                 ("prefix_hits", "prefix_cache_hits"), ("rss_bytes", "rss_bytes"))
# an engine lane's constants, from its first sample
ENGINE_CONSTANTS = ("kv_pool_blocks", "kv_block_bytes", "weights_bytes")
JOB_FIELDS = ("rows_done", "error_rows", "output_tokens")


@dataclass
class Lane:
    interval_s: float = SAMPLE_INTERVAL_S
    columns: dict[str, list] = field(default_factory=dict)  # "t" (seconds since the run started) and the fields
    constants: dict[str, Any] = field(default_factory=dict)
    last_t: float = float("-inf")

    def due(self, t: float) -> bool:
        return t - self.last_t >= self.interval_s

    def add(self, t: float, values: dict[str, Any]) -> None:
        self.last_t = t
        for name, value in (("t", round(t, 3)), *values.items()):
            self.columns.setdefault(name, []).append(value)
        if len(self.columns["t"]) > MAX_SAMPLES:  # MAX_SAMPLES + 1 of them: every other, the first and the newest
            self.columns = {name: column[::2] for name, column in self.columns.items()}
            self.interval_s *= 2

    def to_json(self) -> dict:
        return {"interval_s": self.interval_s, "constants": self.constants, "columns": self.columns}


class Timeline:
    """This run's lanes, and the earlier runs' as read from the output."""

    def __init__(self, earlier_runs: list[dict] | None = None, rows_at_start: int = 0) -> None:
        self.earlier_runs = (earlier_runs or [])[-(MAX_RUNS - 1):]
        self.run_id = uuid.uuid4().hex[:12]
        self.started_at = datetime.now(timezone.utc)
        self.started = time.monotonic()
        self.rows_at_start = rows_at_start
        self.lanes: dict[str, Lane] = {}
        self.last_written = float("-inf")

    def now(self) -> float:
        return time.monotonic() - self.started

    def observe_engine(self, lane: str, stats: dict, force: bool = False) -> None:
        """A sample of an engine's stats (Engine.stats()), if the lane is due one."""
        t, target = self.now(), self.lanes.setdefault(lane, Lane())
        if not force and not target.due(t):
            return
        if not target.constants:
            target.constants = {key: stats.get(key) for key in ENGINE_CONSTANTS}
        target.add(t, {name: stats.get(key) for name, key in ENGINE_FIELDS})

    def observe_job(self, rows_done: int, error_rows: int, output_tokens: int, force: bool = False) -> None:
        t, target = self.now(), self.lanes.setdefault("job", Lane())
        if force or target.due(t):
            target.add(t, {"rows_done": rows_done, "error_rows": error_rows, "output_tokens": output_tokens})

    def run_json(self, status: str) -> dict:
        return {"run_id": self.run_id, "started_at": self.started_at.isoformat(),
                "started_unix": self.started_at.timestamp(), "duration_s": round(self.now(), 3),
                "status": status, "rows_at_start": self.rows_at_start,
                "lanes": {name: lane.to_json() for name, lane in self.lanes.items() if lane.columns}}

    def to_json(self, fingerprint: str, status: str) -> dict:
        return {"format": FORMAT, "job": job_key(fingerprint), "runs": [*self.earlier_runs, self.run_json(status)]}

    def write_due(self) -> bool:
        """Whether a write now keeps to WRITE_INTERVAL_S (and marks it written)."""
        if time.monotonic() - self.last_written < WRITE_INTERVAL_S:
            return False
        self.last_written = time.monotonic()
        return True


def job_key(fingerprint: str) -> str:
    """What ties a timeline to its job: a digest of the job's fingerprint (the parts carry it whole)."""
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def parse_timeline(text: str | None, fingerprint: str | None = None) -> dict | None:
    """A `_timeline.json`'s content; None when absent, not batchgen's, or (with `fingerprint`) another job's."""
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("runs"), list):
        return None
    if fingerprint is not None and data.get("job") != job_key(fingerprint):
        return None
    return data
