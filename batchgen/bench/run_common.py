"""What the generation bench (harness.py) and the prefill-only one (task_harness.py) share: the result of a run,
the dtype as the engine resolves it, and the commit of the code that runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .system_types import SystemRun


@dataclass
class BenchResult:
    record: dict[str, Any]
    record_path: Path
    chart_path: Path
    archive_path: Path
    runs: dict[str, SystemRun] = field(default_factory=dict)


def resolved_dtype(name: str, device: str) -> str:
    """A dtype setting ('auto' too) as the engine resolves it on `device` ('auto' too): 'float32', 'bfloat16'."""
    from batchgen.engine.engine_plan import resolve_target

    return resolve_target(device, name).dtype.name


def git_commit() -> str | None:
    """The commit of the checkout batchgen runs from, None for an installed batchgen (bench/checkout.py: git never
    runs in the package's own directory)."""
    from .checkout import git_commit as checkout_commit

    return checkout_commit()
