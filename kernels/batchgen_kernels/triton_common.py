"""Pieces the Triton attention kernels share."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels use exp2: exp(x) == exp2(x * LOG2E)


def dot_needs_fp32(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bf16 tiles as their raw 16-bit integers (it keeps bf16 as uint16 and its
    tl.dot does not convert), so under TRITON_INTERPRET the kernels widen bf16 operands to fp32 first. The products
    of bf16 values are exact in fp32, so this changes nothing but the instruction on a GPU, where it is never set."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


@triton.jit
def dot(a, b, WIDEN: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 inputs multiply as IEEE fp32 (no TF32 rounding)."""
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")
