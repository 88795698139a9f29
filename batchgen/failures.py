"""How batchgen's command line ends: its exit codes and a failure's one last `batchgen: error: ...` line."""
from __future__ import annotations

import sys
import traceback

import click

EXIT_OK, EXIT_RUNTIME, EXIT_JOB, EXIT_INTERRUPTED = 0, 1, 2, 130


def fail(code: int, message: str, debug: bool = False) -> None:
    if debug and sys.exc_info()[0] is not None:
        traceback.print_exc()
    one_line = " ".join(line.strip() for line in message.splitlines() if line.strip())
    click.echo(f"batchgen: error: {one_line}", err=True)
    sys.exit(code)
