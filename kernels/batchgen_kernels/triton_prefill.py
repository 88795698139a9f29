"""Paged prefill attention in Triton over a varlen batch whose sequences may start after a cached prefix.

A program owns BLOCK_M query rows of one sequence and one query head. Sequence i's query rows
query_start_loc[i]:query_start_loc[i+1] are the last q_len positions of its seq_lens[i]-token context, so row j
sits at absolute position (seq_len - q_len) + j and sees keys 0..that position: the cached prefix in full, the
new tokens causally. Keys are read tile by tile through the block table, with an online softmax. Under a sliding
window (`window` > 0, a runtime argument: -1 for none) row j sees only its last `window` keys: a program's key loop
starts at its first row's window start, and each row is masked to its own window.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .metadata import kernel_window
from .reference import KVScales
from .triton_common import (LOG2E, dot, dot_needs_fp32, kv_scale_args, load_kv_tile, online_softmax_update,
                            paged_slots, unpipelined_for_fp32)


# first_seq (the step's number of decodes) and the block table's width change from step to step: not specialised on,
# so that a new value compiles no new variant mid-run (triton_aot.py counts the variants a run needs); nor is the
# window, so that one variant serves windowed and full layers.
@triton.jit(do_not_specialize=["first_seq", "stride_bt", "window"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, query_start_loc_ptr,
                    seq_lens_ptr, block_tables_ptr,
                    first_seq, scale_log2, window,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    stride_sb, stride_ss,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    WIDEN_DOT: tl.constexpr, KV_INT8: tl.constexpr):
    q_tile = tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= q_len:  # the grid is sized for the longest query in the batch
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)
    if not KV_INT8:  # an int8 cache's tiles are converted to q's dtype instead
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = prefix_len + rows
    window_start = tl.where(window > 0, tl.maximum(q_pos - window + 1, 0), 0)  # each row's first visible key

    # Not -inf: a row may see no key of a tile (one before its window), where exp2(m - m_new) must be 1, not NaN.
    # From the first tile a row sees, exp2(-1e30 - m_new) is 0, as exp2(-inf) was.
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    key_end = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_M)  # nothing past this tile's last row
    key_start = tl.where(window > 0, tl.maximum(prefix_len + q_tile * BLOCK_M - window + 1, 0), 0)  # nor before
    for tile in range(key_start, key_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < key_end
        block, in_block = paged_slots(table, pos, pos_ok, BLOCK_SIZE)
        k, k_scale = load_kv_tile(k_cache_ptr, k_scale_ptr, block, in_block, kv_head, stride_kb, stride_ks,
                                  stride_kh, stride_sb, stride_ss, dims, pos_ok, dim_ok, q, KV_INT8)
        scores = dot(q, tl.trans(k), WIDEN_DOT) * scale_log2
        if KV_INT8:
            scores = scores * k_scale[None, :]
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= window_start[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        v, v_scale = load_kv_tile(v_cache_ptr, v_scale_ptr, block, in_block, kv_head, stride_vb, stride_vs,
                                  stride_vh, stride_sb, stride_ss, dims, pos_ok, dim_ok, q, KV_INT8)
        m, l, acc = online_softmax_update(scores, m, l, acc, v, v_scale, WIDEN_DOT, KV_INT8)

    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # l == 0: a row past q_len (not stored) whose window is past the keys
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, first_seq: int, num_seqs: int,
                  max_query_len: int, scale: float, out: torch.Tensor | None = None,
                  block_m: int | None = None, block_n: int | None = None, window: int | None = None,
                  kv_scales: KVScales | None = None) -> torch.Tensor:
    """Attention for the query rows of sequences first_seq .. first_seq + num_seqs - 1 of a varlen batch, each row
    seeing its last `window` keys under a sliding window. An int8 cache comes with its `kv_scales`.

    q: [T, Hq, D] holds the whole batch; only those sequences' rows of `out` are written. The tiles default to
    prefill_launch's; tests pass others.
    """
    total_tokens, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    head_dim_pad = triton.next_power_of_2(head_dim)
    k_scale, v_scale, stride_sb, stride_ss, kv_int8 = kv_scale_args(k_cache, kv_scales)
    tile_dtype = q.dtype if kv_int8 else k_cache.dtype  # the dtype the dots multiply in
    default_m, default_n, num_warps = prefill_launch(head_dim_pad, tile_dtype)
    block_m, block_n = block_m or default_m, block_n or default_n
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0 or total_tokens == 0:
        return out
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), num_seqs, q_heads)](
        q, k_cache, v_cache, k_scale, v_scale, out, query_start_loc, seq_lens, block_tables, first_seq, scale * LOG2E,
        kernel_window(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), stride_sb, stride_ss,
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        WIDEN_DOT=dot_needs_fp32(tile_dtype), KV_INT8=kv_int8, num_warps=num_warps,
        **unpipelined_for_fp32(kv_int8, q.dtype))
    return out


def prefill_launch(head_dim_pad: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the largest tiles that the AOT compile test (tests/test_triton_aot.py) shows
    compiling without register spills for sm_80 and sm_90, with Triton 3.6 and 3.9. 16-bit: 64x64, key tiles of 32
    for a head of 256. fp32 (no tensor cores, twice the bytes): 32x32; 64x64 spilled up to 10 KB per thread. 8 warps
    from a (padded) head of 128 on: with 4, the [BLOCK_M, head] accumulator and the tiles spill on sm_80."""
    num_warps = 8 if head_dim_pad >= 128 else 4
    if dtype == torch.float32:
        return 32, 32, num_warps
    return 64, 32 if head_dim_pad >= 256 else 64, num_warps
