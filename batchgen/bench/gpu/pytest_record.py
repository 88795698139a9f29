"""A pytest plugin for the GPU check's step 1 (`-p batchgen.bench.gpu.pytest_record`): each test's outcome, as one
JSON line appended to $BATCHGEN_TEST_RECORD the moment it is known, so a run stopped by its budget still tells
which tests passed. Nothing is imported from pytest: the hooks are found by name."""
from __future__ import annotations

import json
import os

RECORD_VARIABLE = "BATCHGEN_TEST_RECORD"
MESSAGE_CHARS = 3000


def _append(entry: dict) -> None:
    path = os.environ.get(RECORD_VARIABLE)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _outcome(report) -> str:
    """passed / failed / skipped / error: a failure outside the test's call (setup, teardown) is an error."""
    if report.failed and report.when != "call":
        return "error"
    return report.outcome


def pytest_runtest_logreport(report) -> None:
    # A test reports three times (setup, call, teardown); keep its call, and a setup or teardown that did not pass
    # (a skip or an error there).
    if report.when != "call" and report.passed:
        return
    entry = {"nodeid": report.nodeid, "outcome": _outcome(report), "when": report.when,
             "duration_s": round(report.duration, 3)}
    if report.failed:
        entry["message"] = report.longreprtext[-MESSAGE_CHARS:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        entry["message"] = str(report.longrepr[2])  # (file, line, reason)
    _append(entry)


def pytest_collectreport(report) -> None:
    if report.failed:
        _append({"nodeid": report.nodeid, "outcome": "error", "when": "collect",
                 "message": report.longreprtext[-MESSAGE_CHARS:]})
