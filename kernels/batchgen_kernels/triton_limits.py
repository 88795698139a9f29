"""The shapes the Triton kernels compile for on a GPU, in one place (importable without Triton).

Each limit is what the ahead-of-time compile test (tests/test_triton_aot.py, batchgen_kernels/triton_aot.py) shows:
it compiles the kernels at the edges of this envelope for sm_90 and sm_80, and its planted cases just outside
fail. The engine checks a model against it at construction (batchgen/engine/startup.py), so an unsupported shape is
one clear error before the weights load instead of a compile failure in the middle of a run. Triton's interpreter
(the CPU tests) is not bound by these limits.
"""
from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# tl.dot, the kernels' matrix multiply, needs at least 16 along the reduction dimension, the head dimension
# (Q·Kᵀ); below that it does not compile.
MIN_HEAD_DIM = 16
# Bytes of one head row, padded to a power of two: past 512 (fp32 above 128, 16-bit above 256) the prefill's
# pipelined K/V tiles need more shared memory than an A100 has per block (163 KB).
MAX_HEAD_ROW_BYTES = 512
# Query heads per KV head: the decode kernel holds a group's heads in one tile of max(16, next power of two) rows;
# the AOT test compiles groups up to this one.
MAX_GROUP = 16


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def unsupported_reason(head_dim: int, num_q_heads: int, num_kv_heads: int, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot run attention of this shape on a GPU, or None when they can."""
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of {', '.join(str(d) for d in DTYPES)}"
    if head_dim < MIN_HEAD_DIM:
        return (f"head_dim {head_dim} is below {MIN_HEAD_DIM}: tl.dot, the kernels' matrix multiply, needs at least "
                f"{MIN_HEAD_DIM} along the head dimension and does not compile for less")
    row_bytes = next_power_of_2(head_dim) * torch.finfo(dtype).bits // 8
    if row_bytes > MAX_HEAD_ROW_BYTES:
        return (f"head_dim {head_dim} in {dtype} is a {row_bytes}-byte head row (padded to a power of two), above "
                f"{MAX_HEAD_ROW_BYTES}: the prefill's K/V tiles would not fit in an A100's shared memory")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads do not divide evenly over {num_kv_heads} KV heads"
    if num_q_heads // num_kv_heads > MAX_GROUP:
        return (f"{num_q_heads // num_kv_heads} query heads per KV head is more than {MAX_GROUP}, the largest group "
                f"the compile test covers")
    return None
