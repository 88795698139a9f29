"""Step 1: the Triton kernel tests and the CUDA-only tests, run by pytest on the GPU. There they execute the kernels
as compiled for the device: the bf16 paths on tensor cores for the first time (under the interpreter, which CI runs,
bf16 dots are widened to fp32: kernels/batchgen_kernels/triton_common.py). Each test's outcome is recorded as it
ends (pytest_record.py), so a run stopped by the step's budget still tells which passed.

The tests are the checkout's test suite, not part of the package: this step runs them only when the check runs from
a checkout (its root the current directory, its batchgen the one imported: bench/checkout.py). From an installed
batchgen the step is skipped, saying so in its JSON and the closing table; steps 2 and 3 still run the kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from batchgen.bench.checkout import NOT_A_CHECKOUT, checkout_root

from .pytest_record import RECORD_VARIABLE

GPU_TESTS = (  # in the checkout's test suite, what runs on the device: every kernel test, then each that needs CUDA
    "tests/test_triton_kernels.py",
    "tests/test_triton_int8.py",
    "tests/test_cuda_path.py::test_captured_decode_steps_match_the_unpadded_ones",
    "tests/test_cuda_path.py::test_engine_on_cuda_with_graphs_matches_eager_and_transformers",
    "tests/test_sampler.py::test_cuda_draws_the_same_bits_as_cpu_and_stays_batch_independent",
)
# pytest -k per mode: --quick keeps the kernel tests with bf16 cases and the CUDA ones; a dry run (on the CPU, under
# the interpreter) one quick kernel test, the CUDA-only ones being collected (their names checked) and skipped.
KEYWORDS = {"full": None,
            "quick": "split_decode or mixed_step or int8 or model_on_triton or cuda_path or cuda_draws",
            "dry-run": "negative_slots or model_on_triton or cuda_path or cuda_draws"}


def pytest_command(mode: str) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
               "-p", "batchgen.bench.gpu.pytest_record", *GPU_TESTS]
    return command + (["-k", KEYWORDS[mode]] if KEYWORDS[mode] else [])


def read_outcomes(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_kernel_tests(args, record) -> bool:
    command = pytest_command(args.mode)
    record["selection"] = {"tests": list(GPU_TESTS), "keyword": KEYWORDS[args.mode], "command": command}
    root = checkout_root()
    if root is None:
        record.update(returncode=None, counts={}, tests=[],
                      skipped=f"{NOT_A_CHECKOUT}: these are the checkout's tests; run the check from its root "
                              f"(PYTHONPATH=.:kernels python -m batchgen.bench --gpu) to run them")
        print(f"[{record['name']}] skipped: {record['skipped']}", file=sys.stderr, flush=True)
        return True
    outcomes_path = Path(args.work_dir) / "step1_tests.jsonl"
    outcomes_path.unlink(missing_ok=True)
    env = {**os.environ, RECORD_VARIABLE: str(outcomes_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), str(root / "kernels"),
                                                       os.environ.get("PYTHONPATH")]))}
    timeout = max(1.0, record.seconds_left())
    try:
        record["returncode"] = subprocess.run(command, cwd=root, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        record["returncode"] = None
        record["stopped"] = f"pytest stopped after {timeout:.0f} s (the step's budget): the tests below had ended"
    record["tests"] = read_outcomes(outcomes_path)
    record["counts"] = dict(Counter(entry["outcome"] for entry in record["tests"]))
    bad = record["counts"].get("failed", 0) + record["counts"].get("error", 0)
    return record["returncode"] == 0 and bad == 0 and record["counts"].get("passed", 0) > 0
