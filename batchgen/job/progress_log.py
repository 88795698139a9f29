"""Progress for logs. A scheduled run (cron, Airflow, Kubernetes) has no terminal, so no progress bar: instead one log
line every `interval_s` seconds with rows done, the rates over the last interval, the ETA, KV use, preemptions and
error rows. `--log-format json` makes every line batchgen logs one JSON object (`JsonFormatter`): a progress line
carries its numbers under "progress", the final summary under "summary"."""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime, timezone

from .runner import Progress

log = logging.getLogger("batchgen.progress")


class JsonFormatter(logging.Formatter):
    """A log record as one JSON line: time, level, logger, message, and the record's `progress` or `summary`."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
                 "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        for key in ("progress", "summary"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        return json.dumps(entry, default=str)


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class ProgressLog:
    """Logs `progress_fields` every `interval_s` seconds from a thread of its own, from the run's start to its end.
    It only reads the Progress the run updates (ints and a dict it replaces whole), never the engine."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.progress: Progress | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[float, int, int] | None = None  # (time, rows this run, output tokens) at the last line

    def start(self, progress: Progress) -> None:
        self.progress = progress
        self._last = (time.monotonic(), progress.rows_this_run, progress.output_tokens)
        self._thread = threading.Thread(target=self._loop, name="batchgen-progress", daemon=True)
        self._thread.start()

    def update(self, progress: Progress) -> None:
        self.progress = progress

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.emit()

    def emit(self) -> None:
        fields = self.fields()
        kv = f", KV {fields['kv_in_use']:.0%} in use" if fields["kv_in_use"] is not None else ""
        log.info("progress %s/%s rows (%.1f%%), %.2f rows/s, %.1f output tok/s over the last %.0f s, ETA %s%s, "
                 "%s preemptions, %s error rows", f"{fields['rows_done']:,}", f"{fields['rows_total']:,}",
                 fields["percent"], fields["rows_per_s"], fields["output_tokens_per_s"], fields["interval_s"],
                 eta_text(fields["eta_s"]), kv, f"{fields['preemptions']:,}", f"{fields['error_rows']:,}",
                 extra={"progress": fields})

    def fields(self) -> dict:
        """The line's numbers: rates over the time since the last line, the ETA at that rate."""
        p, now = self.progress, time.monotonic()
        then, rows, tokens = self._last
        self._last = (now, p.rows_this_run, p.output_tokens)
        elapsed = max(now - then, 1e-9)
        rows_per_s = (p.rows_this_run - rows) / elapsed
        left = p.rows_total - p.rows_done
        since = now - (p.generation_started or p.started)
        eta_rate = rows_per_s or (p.rows_this_run / since if since > 0 else 0.0)  # a quiet interval: the run's rate
        stats = p.engine_stats
        in_use = stats["kv_blocks_in_use"] / stats["kv_pool_blocks"] if stats.get("kv_pool_blocks") else None
        return {"rows_done": p.rows_done, "rows_total": p.rows_total,
                "percent": 100.0 * p.rows_done / p.rows_total if p.rows_total else 100.0,
                "rows_per_s": rows_per_s, "output_tokens_per_s": (p.output_tokens - tokens) / elapsed,
                "interval_s": elapsed, "eta_s": left / eta_rate if eta_rate > 0 else (0.0 if not left else None),
                "kv_in_use": in_use, "preemptions": stats.get("num_preemptions", p.preemptions),
                "error_rows": p.error_rows}
