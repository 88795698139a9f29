"""The GPU check's steps, in order: what each runs, the keys its JSON adds, and its time budget in each mode. The
budgets of a mode add up to what that mode may take on an H200 (full 8 minutes, --quick 3 min 50 s); a step past its
budget is stopped and the next one runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .options import STEP_NAMES
from .step_environment import run_environment
from .step_greedy import run_greedy
from .step_kernel_tests import run_kernel_tests
from .step_throughput import run_throughput


@dataclass(frozen=True)
class Step:
    number: int
    name: str
    run: Callable  # (args, StepRecord) -> ok
    keys: tuple[str, ...]  # what its JSON has beyond step_record.COMMON_KEYS once it has run to its end
    budget_s: dict  # mode -> seconds


STEPS = (
    Step(0, "environment", run_environment,
         ("gpu", "driver", "versions", "c_compiler", "python_headers", "libcuda", "git_commit", "missing"),
         {"full": 20, "quick": 15, "dry-run": 60}),
    Step(1, "kernel_tests", run_kernel_tests, ("selection", "returncode", "counts", "tests"),
         {"full": 170, "quick": 80, "dry-run": 90}),
    Step(2, "greedy", run_greedy, ("model", "engine_load", "greedy_bf16"),
         {"full": 110, "quick": 55, "dry-run": 90}),
    Step(3, "throughput", run_throughput, ("model", "rates", "kv_int8", "hf_static", "engine_load", "batchgen",
                                           "decode", "targets"),
         {"full": 180, "quick": 80, "dry-run": 90}),
)
assert tuple(step.name for step in STEPS) == STEP_NAMES

STEP_BY_NAME = {step.name: step for step in STEPS}
