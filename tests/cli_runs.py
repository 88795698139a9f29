"""Running `batchgen run` as a user does, in a subprocess, and reading what it wrote: shared by the end-to-end tests
that drive a job through the CLI quietly."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl


def run_cli(job: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), "--quiet", *args],
                          capture_output=True, text=True, timeout=900)


def read(out: Path) -> pl.DataFrame:
    return pl.read_parquet(f"{out}/*.parquet")


def kill_after_parts(job: Path | list[str], out: Path, parts: int, timeout: float = 600) -> None:
    """Run the job (or the batchgen command line `job`) until it has committed `parts` run parts, then SIGKILL it."""
    args = job if isinstance(job, list) else ["run", str(job)]
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", *args, "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while len(list(out.glob("run-*.parquet"))) < parts and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
