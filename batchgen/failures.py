"""How batchgen's command line ends: its exit codes and a failure's one last `batchgen: error: ...` line."""
from __future__ import annotations

import json
import sys
import traceback
from datetime import datetime, timezone

import click

EXIT_OK, EXIT_RUNTIME, EXIT_JOB, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_BUSY = 75  # EX_TEMPFAIL: another run is writing the output; retry later (a scheduler tells it from a bad job)


def fail(code: int, message: str, debug: bool = False, as_json: bool = False) -> None:
    """as_json (--log-format json): the line is a JSON object, as every other log line then is (progress_log's
    JsonFormatter: the same keys, time first)."""
    if debug and sys.exc_info()[0] is not None:
        traceback.print_exc()
    one_line = " ".join(line.strip() for line in message.splitlines() if line.strip())
    entry = {"time": datetime.now(timezone.utc).isoformat(), "level": "error", "logger": "batchgen",
             "message": one_line, "exit_code": code}
    click.echo(json.dumps(entry) if as_json else f"batchgen: error: {one_line}", err=True)
    sys.exit(code)
