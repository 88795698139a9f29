"""Step 1: the Triton kernel tests and the CUDA-only tests, run by pytest on the GPU. There they execute the kernels
as compiled for the device: the bf16 paths on tensor cores for the first time (under the interpreter, which CI runs,
bf16 dots are widened to fp32: kernels/batchgen_kernels/triton_common.py). Each test's outcome is recorded as it
ends (pytest_record.py), so a run stopped by the step's budget still tells which passed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from .options import SOURCE_TREE
from .pytest_record import RECORD_VARIABLE

GPU_TESTS = (  # what runs on the device: every kernel test, then each test that needs CUDA
    "tests/test_triton_kernels.py",
    "tests/test_cuda_path.py::test_captured_decode_steps_match_the_unpadded_ones",
    "tests/test_cuda_path.py::test_engine_on_cuda_with_graphs_matches_eager_and_transformers",
    "tests/test_sampler.py::test_cuda_draws_the_same_bits_as_cpu_and_stays_batch_independent",
)
# pytest -k per mode: --quick keeps the kernel tests with bf16 cases and the CUDA ones; a dry run (on the CPU, under
# the interpreter) one quick kernel test, the CUDA-only ones being collected (their names checked) and skipped.
KEYWORDS = {"full": None,
            "quick": "split_decode or mixed_step or model_on_triton or cuda_path or cuda_draws",
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
    if not (SOURCE_TREE / "tests").is_dir():
        raise FileNotFoundError(f"no tests/ in {SOURCE_TREE}: step 1 runs from a source checkout")
    outcomes_path = Path(args.work_dir) / "step1_tests.jsonl"
    outcomes_path.unlink(missing_ok=True)
    command = pytest_command(args.mode)
    record["selection"] = {"tests": list(GPU_TESTS), "keyword": KEYWORDS[args.mode], "command": command}
    env = {**os.environ, RECORD_VARIABLE: str(outcomes_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE_TREE), str(SOURCE_TREE / "kernels"),
                                                       os.environ.get("PYTHONPATH")]))}
    timeout = max(1.0, record.seconds_left())
    try:
        record["returncode"] = subprocess.run(command, cwd=SOURCE_TREE, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        record["returncode"] = None
        record["stopped"] = f"pytest stopped after {timeout:.0f} s (the step's budget): the tests below had ended"
    record["tests"] = read_outcomes(outcomes_path)
    record["counts"] = dict(Counter(entry["outcome"] for entry in record["tests"]))
    bad = record["counts"].get("failed", 0) + record["counts"].get("error", 0)
    return record["returncode"] == 0 and bad == 0 and record["counts"].get("passed", 0) > 0
