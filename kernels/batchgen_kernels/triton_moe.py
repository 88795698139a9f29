"""The experts of a sparse MoE layer on a GPU: one grouped matmul launch per projection for all active experts.

batchgen/models/moe.py's `run_experts` runs each active expert as its own pair of matmuls, a Python loop that reads
each expert's row count back to the host; on CUDA that is a host sync per layer, and a CUDA graph cannot capture it.
Here, in the manner of vLLM's fused_moe, the step's (token, slot) rows are sorted by expert on the device and padded
so that each BLOCK_M block of the sorted list belongs to one expert (`align_by_expert`, torch ops only); a program of
`_grouped_matmul_kernel` owns one (block, BLOCK_N columns) tile, reads its expert's id and its rows' ids, gathers
their input rows and multiplies them by that expert's slice of a stacked weight [E, N, K]. The grid is sized by an
upper bound on the blocks (T * k + E * (BLOCK_M - 1) rows), known on the host; the programs past the real count
(on the device) return at once. Nothing is read back to the host.

Numerics are run_experts': fp32 accumulation, each matmul's output rounded to the model's dtype as a Linear's is,
silu_mul between them by the model's own elementwise op, the routing weight multiplied in after the down
projection's rounding (an fp32 product for Mixtral's fp32 weights), the rows written to their (token, slot) row of
a [T * k, H] buffer and summed over the k slots in slot order by torch, rounded to the model's dtype once.

Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (the tests); on a GPU it has only been compiled ahead of time
(tests/test_triton_aot.py), never run.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from .triton_common import dot, dot_needs_fp32


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_matmul_kernel(a_ptr, w_ptr, out_ptr, route_ptr, sorted_ids_ptr, block_experts_ptr, num_blocks_ptr,
                           num_rows, N, K, stride_am, stride_we, stride_wn, stride_om,
                           A_ROW_DIV: tl.constexpr, ROUTE: tl.constexpr, EVEN_K: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, WIDEN_DOT: tl.constexpr):
    """out[r] = a[r // A_ROW_DIV] @ w[e].T for each row id r of a block of expert e (times route[r] with ROUTE).

    Row ids come from sorted_ids (num_rows: padding); block b's expert is block_experts[b]; only the first
    num_blocks_ptr[0] blocks hold rows. w is [E, N, K] with K contiguous; a's and out's rows are contiguous."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    # GROUP_M row blocks side by side walk the column tiles together, so a weight tile is read while it is in L2
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    if pid_m >= tl.load(num_blocks_ptr):
        return  # past the step's real blocks: the grid is an upper bound

    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = ids < num_rows
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (ids // A_ROW_DIV)[:, None] * stride_am + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = k0 + ks < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += dot(a, w, WIDEN_DOT)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    out = acc.to(a_ptr.dtype.element_ty)  # a Linear's output, in the model's dtype
    if ROUTE:  # then times the routing weight, as a torch product of the two dtypes computes it
        weight = tl.load(route_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)
        out = out.to(tl.float32) * weight[:, None]
    tl.store(out_ptr + ids[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def block_m_for(num_rows: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's least) while the experts average few rows each (decode), where a block of 64
    would be mostly padding; 64 once they average 32 or more (prefill). A choice, not a measurement."""
    return 64 if num_rows >= 32 * num_experts else 16


def launch_config(block_m: int, dtype: torch.dtype) -> dict:
    """Tile and launch settings. Shared memory per block, pipelined over num_stages: at most
    3 x (16 x 128 + 128 x 64) x 2 bytes = 60 KiB in 16-bit, within an A100's 163 KiB (the AOT test checks)."""
    block_k = 32 if dtype == torch.float32 else (128 if block_m == 16 else 64)
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=3)


def padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most rows the sorted list can need: each expert's rows padded to whole blocks adds under one block per
    expert. Rounded up to whole blocks."""
    return triton.cdiv(num_rows + num_experts * (block_m - 1), block_m) * block_m


def align_by_expert(expert_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] → (sorted_ids [S] int32, block_experts [S / block_m] int32, num_blocks [1] int32), with
    S = padded_rows(T * k, E, block_m), by torch ops alone (no host sync: a CUDA graph can capture it).

    Row id r = t * k + j is token t's j-th slot. sorted_ids lists the row ids grouped by expert (expert 0 first),
    each expert's in ascending order, each expert's group padded with T * k to a multiple of block_m: block b
    (sorted_ids[b * block_m:(b + 1) * block_m]) belongs to expert block_experts[b]. The first num_blocks blocks hold
    every row; the blocks after them are padding only, with expert -1. An expert with no rows has no block."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    num_rows, device = flat.numel(), flat.device
    size = padded_rows(num_rows, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # torch.bincount would size its output from a host read
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # row ids grouped by expert, ascending within each
    by_expert = flat[order]
    rank = torch.arange(num_rows, device=device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    sorted_ids = torch.full((size,), num_rows, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, (padded_end - padded)[by_expert] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)  # first expert ending past the block
    num_blocks = (padded_end[-1:] // block_m).to(torch.int32)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_ids, block_experts, num_blocks


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                   block_experts: torch.Tensor, num_blocks: torch.Tensor, a_row_div: int,
                   route: torch.Tensor | None, config: dict) -> torch.Tensor:
    """One launch: out[r] = a[r // a_row_div] @ w[e].T (x route[r]) for every row id r in sorted_ids."""
    if a.stride(-1) != 1 or w.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("grouped_matmul needs a, w and out contiguous in their last dimension")
    n, k = w.shape[1], w.shape[2]
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    grid = (sorted_ids.numel() // block_m * triton.cdiv(n, block_n),)
    _grouped_matmul_kernel[grid](
        a, w, out, out if route is None else route, sorted_ids, block_experts, num_blocks,
        out.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, ROUTE=route is not None, EVEN_K=k % block_k == 0, WIDEN_DOT=dot_needs_fp32(a.dtype),
        **config)
    return out


def grouped_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                    expert_ids: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """moe.run_experts on stacked weights: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], routing weights and
    expert ids [T, k] → [T, H] in x's dtype. gate/up grouped matmul, silu_mul, down grouped matmul times the routing
    weight, each (token, slot) row in its own row of one [T * k, H] buffer, summed over the k slots."""
    num_tokens, top_k = expert_ids.shape
    num_experts, hidden = w_gate_up.shape[0], x.shape[-1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_rows = num_tokens * top_k
    block_m = block_m_for(num_rows, num_experts)
    config = launch_config(block_m, x.dtype)
    sorted_ids, block_experts, num_blocks = align_by_expert(expert_ids, num_experts, block_m)
    gate_up = x.new_empty(num_rows, w_gate_up.shape[1])
    grouped_matmul(x, w_gate_up, gate_up, sorted_ids, block_experts, num_blocks, top_k, None, config)
    act = silu_mul(gate_up)
    del gate_up
    act = act if act.stride(-1) == 1 else act.contiguous()
    by_slot = x.new_empty(num_rows, hidden, dtype=torch.promote_types(x.dtype, weights.dtype))
    grouped_matmul(act, w_down, by_slot, sorted_ids, block_experts, num_blocks, 1, weights.reshape(-1).contiguous(),
                   config)
    return by_slot.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
