"""Running `batchgen run` as a user does, in a subprocess, and reading what it wrote: shared by the end-to-end tests
that drive a job through the CLI quietly."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl


def run_cli(job: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), "--quiet", *args],
                          capture_output=True, text=True, timeout=900)


def read(out: Path) -> pl.DataFrame:
    return pl.read_parquet(f"{out}/*.parquet")
