"""What oneDNN runs for batchgen's packed linears (batchgen/models/packed_linear.py), read from its verbose log in a
fresh process: the weight is laid out once, when it is packed, never again per call, for 1 to 300 rows; and on a CPU
with AMX a bf16 linear runs on oneDNN's AMX kernels, so packing does not keep bf16 matmuls off the tiles
(docs/kernels.md: the choice per CPU kind)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchgen.machine import cpu_flags
from batchgen.models.packed_linear import packing_supported

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 7, 64, 300)

SCRIPT = f"""
import sys, torch
from batchgen.models.packed_linear import PackedLinear
dtype = getattr(torch, sys.argv[1])
linear = PackedLinear(torch.randn(256, 512).to(dtype), torch.randn(256).to(dtype))
for rows in {ROWS}:
    linear(torch.randn(rows, 512).to(dtype))
"""


def onednn_primitives(dtype: str) -> list[list[str]]:
    """The fields of each primitive oneDNN executed (kind at 5, implementation at 6), in order."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
    result = subprocess.run([sys.executable, "-c", SCRIPT, dtype], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return [line.split(",") for line in result.stdout.splitlines()
            if line.startswith("onednn_verbose,") and ",primitive,exec," in line]


def assert_packed_once(primitives: list[list[str]]) -> list[str]:
    """One reorder (the packing) and one inner product per call; returns the inner products' implementations."""
    kinds = [fields[5] for fields in primitives]
    assert kinds.count("reorder") == 1, kinds
    assert kinds.count("inner_product") == len(ROWS), kinds
    return [fields[6] for fields in primitives if fields[5] == "inner_product"]


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")
def test_an_fp32_weight_is_laid_out_once_whatever_the_rows():
    assert_packed_once(onednn_primitives("float32"))


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                    reason="this CPU has no bf16 matmuls in oneDNN (AVX-512 or newer)")
def test_a_bf16_weight_is_laid_out_once_and_runs_on_amx_where_the_cpu_has_it():
    implementations = assert_packed_once(onednn_primitives("bfloat16"))
    if "amx_bf16" in (cpu_flags() or set()):
        assert all("amx" in name for name in implementations), implementations
