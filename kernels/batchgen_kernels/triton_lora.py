"""Per-row LoRA deltas on a GPU: every row's own adapter's low-rank product in two launches, whatever the number of
adapters in the step (Punica's SGMV: shrink, then expand).

batchgen/lora/lora_linear.py's LoraLinear holds one stacked A [num_slots * rank, in] and one stacked B
[num_slots * rank, out]: slot s (1 ..) owns rows (s - 1) * rank .. s * rank, slot 0 is the base model. For each row i
of slot s > 0: out[i] += (x[i] @ A_s.T) @ B_s. On the CPU it is one torch product per segment (or one over every
slot); here, given each row's slot (int32, 0: no delta, skipped):

- shrink: low[i] = x[i] @ A_s.T, fp32 accumulation, into an fp32 buffer [splits, rows, width]. A grid of (row block,
  split of the input features, chunk of BLOCK_R rank columns); a decode's few row blocks split the input features
  so that more programs share the read of A, the partial sums added in a fixed order by the expand (no atomics:
  the same sum every run).
- expand: out[i] = out[i] + low[i] @ B_s, low rounded to the model's dtype first (as torch's x @ A.T is), the sum
  in fp32 and rounded once (as torch's addmm_). A grid of (row block, block of output columns).

A block of rows may hold rows of several slots (the rows arrive grouped by slot, so at most a few): each program
runs its product once per distinct slot among its rows, the other rows masked out, and a block of slot-0 rows only
returns. Nothing is read back to the host.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests/test_triton_lora.py); on a GPU they have only been
compiled ahead of time (tests/test_triton_aot.py), never run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import dot, dot_needs_fp32

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The widest rank a slot may have (its parts' ranks together: 128 x 3 for a packed q/k/v at rank 128): the edge the
# AOT test compiles. The rank runs in chunks of at most 64 columns, so a wider one would compile the same variants;
# beyond it LoraLinear keeps its torch products.
MAX_RANK = 384
# Programs the shrink aims for: below this many (row blocks x rank chunks), the input features are split.
SHRINK_PROGRAMS = 64
MIN_SPLIT_FEATURES = 256  # no split reads fewer input features than this


@triton.jit(do_not_specialize=["num_rows", "RANK", "stride_ls"])
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, low_ptr, num_rows, K, RANK, k_per_split,
                        stride_xm, stride_ls, stride_lm,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, WIDEN_DOT: tl.constexpr):
    """low[split, r, c] = x[r, split's features] @ a[slot(r) - 1, c, split's features] for the block's rows and
    BLOCK_R rank columns c (0 for rows of slot 0). a is [num_slots * RANK, K], K contiguous; x's rows contiguous."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_r = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    remaining = tl.load(slots_ptr + rows, mask=row_ok, other=0)
    slot = tl.max(remaining, 0)  # the largest slot still to do among the block's rows (0: none left)
    if slot == 0:
        return  # base rows only: the expand skips this block too
    ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < RANK
    ks = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    while slot > 0:
        mine = remaining == slot
        a_rows = a_ptr + ((slot - 1).to(tl.int64) * RANK + ranks[None, :]) * K  # [1, BLOCK_R]
        for k0 in range(k_start, k_end, BLOCK_K):
            k_ok = k0 + ks < k_end
            x = tl.load(x_rows + (k0 + ks)[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_rows + (k0 + ks)[:, None], mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
            acc += dot(x, a, WIDEN_DOT)  # other slots' rows are zeros: they add nothing
        remaining = tl.where(mine, 0, remaining)
        slot = tl.max(remaining, 0)
    tl.store(low_ptr + pid_k * stride_ls + rows[:, None] * stride_lm + ranks[None, :], acc,
             mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit(do_not_specialize=["num_rows", "RANK", "splits", "stride_ls"])
def _lora_expand_kernel(low_ptr, b_ptr, slots_ptr, out_ptr, num_rows, N, RANK, splits, stride_ls, stride_lm,
                        stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        WIDEN_DOT: tl.constexpr):
    """out[r, cols] = out[r, cols] + low[r] @ b[slot(r) - 1, :, cols] for the block's rows of a slot > 0, low the
    sum of the shrink's splits rounded to out's dtype. b is [num_slots * RANK, N], N contiguous."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=0)
    if tl.max(slots, 0) == 0:
        return  # base rows only: out stays as the base computed it
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, RANK, BLOCK_R):
        rank_ok = r0 + rs < RANK
        # never a base row's: a block of them the shrink skipped (its blocks may be larger) was not written
        low_mask = row_ok[:, None] & rank_ok[None, :] & (slots > 0)[:, None]
        low_ptrs = low_ptr + rows[:, None] * stride_lm + (r0 + rs)[None, :]
        low = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for split in range(0, splits):
            low += tl.load(low_ptrs + split * stride_ls, mask=low_mask, other=0.0)
        low = low.to(out_ptr.dtype.element_ty)  # torch's x @ A.T, in the model's dtype
        remaining = slots
        slot = tl.max(remaining, 0)
        while slot > 0:
            mine = remaining == slot
            b_rows = b_ptr + ((slot - 1).to(tl.int64) * RANK + r0 + rs)[:, None] * N  # [BLOCK_R, 1]
            b = tl.load(b_rows + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
            acc += dot(tl.where(mine[:, None], low, tl.zeros_like(low)), b, WIDEN_DOT)
            remaining = tl.where(mine, 0, remaining)
            slot = tl.max(remaining, 0)
    mask = row_ok[:, None] & col_ok[None, :] & (slots > 0)[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (base.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def unsupported_reason(rank: int, dtype: torch.dtype) -> str | None:
    """Why lora_delta does not take slots of this rank in this dtype, or None when it does."""
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of {', '.join(str(d) for d in DTYPES)}"
    if not 1 <= rank <= MAX_RANK:
        return f"a slot of rank {rank}: the LoRA kernel is compiled for ranks 1 to {MAX_RANK} (triton_aot's cases)"
    return None


def block_r_for(rank: int) -> int:
    """Rank columns per chunk: the rank padded to a power of two, at least 16 (tl.dot's least), at most 64."""
    return min(64, max(16, triton.next_power_of_2(rank)))


def launch_config(num_rows: int, rank: int, dtype: torch.dtype) -> dict:
    """Tiles and launch settings, a choice, not a measurement: a decode-sized step (under 64 rows) in blocks of 16
    rows (tl.dot's least), a larger one in blocks of 64 rows for the shrink and of 32 rows x 128 columns for the
    expand (with 64 x 128 tiles, or with 8 warps, ptxas spilled registers in the AOT compile). Shared memory per block: the
    shrink's pipelined x and A tiles, at most 3 x (64 x 64 + 64 x 64) x 2 bytes = 48 KiB in 16-bit (fp32: half the
    features per tile, the same bytes); the expand's low and B tiles, at most 32 x 64 + 64 x 128 values; within an
    A100's 163 KiB (the AOT test checks)."""
    decode = num_rows < 64
    return dict(BLOCK_M=16 if decode else 64, BLOCK_R=block_r_for(rank), BLOCK_K=32 if dtype == torch.float32 else 64,
                num_warps=4, num_stages=3,
                EXPAND_M=16 if decode else 32, BLOCK_N=64 if decode else 128, expand_warps=4, expand_stages=2)


def split_features(num_rows: int, size_in: int, rank: int, config: dict) -> int:
    """Input features per shrink program, a multiple of BLOCK_K: all of them, unless the step's (row blocks x rank
    chunks) programs are fewer than SHRINK_PROGRAMS, then split into up to the missing factor, each at least
    MIN_SPLIT_FEATURES."""
    programs = triton.cdiv(num_rows, config["BLOCK_M"]) * triton.cdiv(rank, config["BLOCK_R"])
    splits = max(1, min(SHRINK_PROGRAMS // programs, size_in // MIN_SPLIT_FEATURES))
    return triton.cdiv(triton.cdiv(size_in, splits), config["BLOCK_K"]) * config["BLOCK_K"]


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, num_slots: int,
               rank: int, out: torch.Tensor) -> torch.Tensor:
    """out[i] += (x[i] @ A_s.T) @ B_s for every row i whose slot s = row_slots[i] is not 0, in place; returns out.

    x [rows, in]; a [num_slots * rank, in] and b [num_slots * rank, out], slot s's rows (s - 1) * rank .. s * rank
    (LoraLinear's stacked buffers); row_slots [rows] int32, each 0 .. num_slots; out [rows, out], x's dtype."""
    num_rows, size_in = x.shape
    size_out = b.shape[1]
    reason = unsupported_reason(rank, x.dtype)
    if reason:
        raise ValueError(f"lora_delta: {reason}")
    if a.shape != (num_slots * rank, size_in) or b.shape[0] != num_slots * rank or out.shape != (num_rows, size_out):
        raise ValueError(f"lora_delta: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, out "
                         f"{tuple(out.shape)} for {num_slots} slots of rank {rank}")
    if not (x.dtype == a.dtype == b.dtype == out.dtype):
        raise ValueError(f"lora_delta: x, a, b and out in one dtype, got {x.dtype}, {a.dtype}, {b.dtype}, {out.dtype}")
    if row_slots.dtype != torch.int32 or row_slots.shape != (num_rows,):
        raise ValueError(f"lora_delta: row_slots must be int32 [{num_rows}], got {row_slots.dtype} "
                         f"{tuple(row_slots.shape)}")
    if out.stride(-1) != 1:
        raise ValueError("lora_delta needs out contiguous in its last dimension")
    if num_rows == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    a, b = a.contiguous(), b.contiguous()
    config = launch_config(num_rows, rank, x.dtype)
    block_m, block_r = config["BLOCK_M"], config["BLOCK_R"]
    k_per_split = split_features(num_rows, size_in, rank, config)
    splits = triton.cdiv(size_in, k_per_split)
    width = triton.cdiv(rank, block_r) * block_r
    low = torch.empty(splits, num_rows, width, dtype=torch.float32, device=x.device)
    widen = dot_needs_fp32(x.dtype)
    row_blocks = triton.cdiv(num_rows, block_m)
    _lora_shrink_kernel[(row_blocks, splits, width // block_r)](
        x, a, row_slots, low, num_rows, size_in, rank, k_per_split, x.stride(0), low.stride(0), low.stride(1),
        BLOCK_M=block_m, BLOCK_K=config["BLOCK_K"], BLOCK_R=block_r, WIDEN_DOT=widen,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    expand_m = config["EXPAND_M"]
    _lora_expand_kernel[(triton.cdiv(num_rows, expand_m), triton.cdiv(size_out, config["BLOCK_N"]))](
        low, b, row_slots, out, num_rows, size_out, rank, splits, low.stride(0), low.stride(1), out.stride(0),
        BLOCK_M=expand_m, BLOCK_N=config["BLOCK_N"], BLOCK_R=block_r, WIDEN_DOT=widen,
        num_warps=config["expand_warps"], num_stages=config["expand_stages"])
    return out
