"""Running the steps: each in its own process (a CUDA error or a hung kernel in one step cannot take the next one
down), stopped at its budget. Its output goes to the terminal and to check.log; a step that ends without its final
JSON (stopped, crashed) gets one saying so, with the end of its output, keeping the phases it had finished."""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .step_record import step_path, write_json

TAIL_LINES = 80  # of a step's output, kept in its JSON when it ends without its own record


@dataclass
class ChildRun:
    returncode: int | None
    timed_out: bool
    wall_s: float
    tail: list[str] = field(default_factory=list)


def child_environment() -> dict:
    """The steps start as the check did (the same interpreter, directory and PYTHONPATH: the same batchgen, a
    checkout's or an installed one); and print as they go, without progress bars (the log's end is what a cut-short
    run returns)."""
    return {"HF_HUB_DISABLE_PROGRESS_BARS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}


def run_child(command: list[str], timeout_s: float, log) -> ChildRun:
    """Run `command` in a process group of its own, its output copied to stderr and `log` line by line; past
    timeout_s the whole group is killed."""
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True, env=child_environment())
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def copy_output() -> None:
        for line in proc.stdout:
            sys.stderr.write(line)
            log.write(line)
            log.flush()
            tail.append(line)

    reader = threading.Thread(target=copy_output, daemon=True)
    reader.start()
    timed_out = False
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the step and what it started (pytest, ptxas)
        returncode = proc.wait()
    reader.join(timeout=10)
    return ChildRun(returncode, timed_out, time.monotonic() - started, list(tail))


def settle(path: Path, number: int, name: str, mode: str, budget_s: float, run: ChildRun) -> dict:
    """The step's record as its process left it; if that process did not get to the step's end, marked failed,
    with why and the end of its output."""
    record = json.loads(path.read_text()) if path.is_file() else {
        "step": number, "name": name, "mode": mode, "ok": False, "finished": False, "error": None, "started": None,
        "budget_s": budget_s, "wall_s": run.wall_s, "phase_s": {}}
    if not record.get("finished"):
        why = (f"stopped at its budget of {budget_s:.0f} s" if run.timed_out
               else f"its process exited with code {run.returncode} before the step's end")
        record.update(ok=False, error=why, wall_s=run.wall_s, output_tail="".join(run.tail))
        write_json(path, record)
    return record


def run_steps(steps: list[tuple[int, str, list[str], float]], out_dir: Path, mode: str, summary: dict) -> list[dict]:
    """(number, name, command, budget) for each step, in order; each one's record as it ended. summary.json is
    rewritten after each step."""
    records = []
    with open(out_dir / "check.log", "a") as log:
        for number, name, command, budget_s in steps:
            print(f"\n=== step {number}: {name} (budget {budget_s:.0f} s)", file=sys.stderr, flush=True)
            log.write(f"\n=== step {number}: {name} (budget {budget_s:.0f} s): {' '.join(command)}\n")
            run = run_child(command, budget_s, log)
            records.append(settle(step_path(out_dir, number, name), number, name, mode, budget_s, run))
            summary["steps"] = [{k: r.get(k) for k in ("step", "name", "ok", "finished", "wall_s", "error")}
                                for r in records]
            write_json(out_dir / "summary.json", summary)
    return records
