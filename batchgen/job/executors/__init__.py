"""The ways a job's rows get generated (executor.kind), side by side behind one interface (base.Executor)."""
from __future__ import annotations

from .base import Executor, ExecutorRun
from .local import LocalExecutor
from .ray import RayExecutor

EXECUTORS: dict[str, type] = {"local": LocalExecutor, "ray": RayExecutor}


def executor_for(kind: str) -> Executor:
    return EXECUTORS[kind]()
