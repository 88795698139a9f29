"""One step's JSON file, written when the step starts, after each of its phases and when it ends: a step cut short
(its budget, a crash) still leaves what it finished. A phase that raises records its error and the step goes on."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

END_MARGIN_S = 10.0  # a step starts nothing new this close to its budget, so it writes its JSON before it is killed
# Keys every step's file has; each step adds its own (steps.py lists them).
COMMON_KEYS = ("step", "name", "mode", "ok", "finished", "error", "started", "budget_s", "wall_s", "phase_s")


def step_path(out_dir: str | Path, number: int, name: str) -> Path:
    return Path(out_dir) / f"step{number}_{name}.json"


def write_json(path: Path, data: dict) -> None:
    """Written whole or not at all: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class StepRecord(dict):
    """The step's result as it grows. `finished` turns true only when the step's own process got to its end (it may
    still have failed: see `ok` and `error`)."""

    def __init__(self, path: Path, number: int, name: str, mode: str, budget_s: float | None) -> None:
        super().__init__(step=number, name=name, mode=mode, ok=False, finished=False, error=None,
                         started=datetime.now(timezone.utc).isoformat(timespec="seconds"), budget_s=budget_s,
                         wall_s=0.0, phase_s={})
        self.path = path
        self._started = time.monotonic()
        self._deadline = None if budget_s is None else self._started + budget_s - END_MARGIN_S
        self.save()

    def seconds_left(self) -> float:
        """Of the step's budget, less the margin kept for writing its result."""
        return float("inf") if self._deadline is None else self._deadline - time.monotonic()

    def save(self) -> None:
        self["wall_s"] = time.monotonic() - self._started
        write_json(self.path, self)

    def phase(self, key: str, fn, keep: bool = True, min_s: float = 0.0, group: str | None = None):
        """fn()'s value, or None if it raised (its error kept under `key`) or fewer than min_s seconds of the
        step's budget are left (then it does not run and `key` says so). Kept under `key` when `keep`; under
        self[group][key] with a group (the decode step times, one per batch size)."""
        where = self if group is None else self.setdefault(group, {})
        label = key if group is None else f"{group}/{key}"
        if self.seconds_left() < min_s:
            where[key] = {"skipped": f"{self.seconds_left():.0f} s of the step's budget left, {min_s:.0f} s needed"}
            self.save()
            return None
        started = time.perf_counter()
        print(f"[{self['name']}] {label} ...", file=sys.stderr, flush=True)
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 -- recorded, and the step goes on
            value = None
            where[key] = {"error": error_text(exc), "traceback": traceback.format_exc()}
            print(f"[{self['name']}] {label} FAILED: {error_text(exc)}", file=sys.stderr, flush=True)
        else:
            if keep:
                where[key] = value
        self["phase_s"][label] = time.perf_counter() - started
        self.save()
        return value

    def failed_phases(self) -> list[str]:
        """'key', or 'group/key', of each phase that raised."""
        failed = []
        for key, value in self.items():
            if isinstance(value, dict) and "error" in value:
                failed.append(key)
            elif isinstance(value, dict):
                failed += [f"{key}/{k}" for k, v in value.items() if isinstance(v, dict) and "error" in v]
        return failed

    def finish(self, ok: bool, exc: BaseException | None = None) -> None:
        """The step's end: ok only if it says so, nothing raised and no phase failed."""
        if exc is not None:
            self["error"] = error_text(exc)
            self["traceback"] = "".join(traceback.format_exception(exc))
        elif self.failed_phases():
            self["error"] = "failed: " + ", ".join(self.failed_phases())
        self["ok"] = bool(ok) and self["error"] is None
        self["finished"] = True
        self.save()
