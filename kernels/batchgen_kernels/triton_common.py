"""Pieces the Triton attention kernels share."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels use exp2: exp(x) == exp2(x * LOG2E)


def interpreting() -> bool:
    """Whether TRITON_INTERPRET is on: the kernels, decorated after it was read, run in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def dot_needs_fp32(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bf16 tiles as their raw 16-bit integers (it keeps bf16 as uint16 and its
    tl.dot does not convert), so under TRITON_INTERPRET the kernels widen bf16 operands to fp32 first. The products
    of bf16 values are exact in fp32, so this changes nothing but the instruction on a GPU, where it is never set."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def dot(a, b, WIDEN: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 inputs multiply as IEEE fp32 (no TF32 rounding)."""
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def paged_slots(table, pos, pos_ok, BLOCK_SIZE: tl.constexpr):
    """Where context positions `pos` of one sequence live: (physical block, offset in block), via its block table."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    return block, pos % BLOCK_SIZE


@triton.jit
def load_paged(cache_ptr, block, in_block, kv_head, stride_b, stride_s, stride_h, dims, mask):
    """A [positions, head_dim] tile of one KV head from a paged cache [num_blocks, block_size, heads, head_dim]."""
    return tl.load(cache_ptr + block[:, None] * stride_b + in_block[:, None] * stride_s + kv_head * stride_h
                   + dims[None, :], mask=mask, other=0.0)


@triton.jit
def online_softmax_update(scores, m, l, acc, v, WIDEN: tl.constexpr):
    """Fold one tile of (log2-domain) scores and its values into the running max m, sum l and output acc."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, WIDEN)
    return m_new, l, acc


def triton_error_reason(exc: BaseException) -> str:
    """One line for a Triton failure. A CompilationError's own message is the kernel's source, and the reason (tl.dot's
    "K >= 16") is in the error it was raised from: the innermost message of the chain is the one that says."""
    reason = ""
    while exc is not None:
        reason = getattr(exc, "error_message", None) or str(exc) or reason
        exc = exc.__cause__
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    return lines[0] if lines else ""
