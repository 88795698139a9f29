"""Paged decode attention in Triton: one query token per sequence, flash-decoding style.

A program owns one (sequence, KV head, context split): it loads all query heads of that KV head's group at once,
so each K/V tile is read once per group, and runs an online softmax over its slice of the context, read through
the block table. With several splits, a second kernel combines the splits' partial (max, sum, output).

The number of splits (the grid) comes from the batch's size and the device's SMs, capped by the longest context
the call may see (`choose_num_splits`); how a sequence's context is cut into them comes from its real length, on
the device (`split_size`). So a CUDA graph captured for contexts up to max_model_len still spreads a short
context over every split it can use, instead of putting it all in the first split of a max_model_len-wide cut.

Under a sliding window (`window` > 0, a runtime argument: -1 for none) a sequence's visible context is its last
min(seq_len, window) tokens, and only that range is cut into splits and read.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .metadata import kernel_window
from .reference import KVScales
from .triton_common import (LOG2E, dot, dot_needs_fp32, kv_scale_args, load_kv_tile, online_softmax_update,
                            paged_slots, unpipelined_for_fp32)

BLOCK_N = 64  # context tokens per inner-loop tile
MIN_TOKENS_PER_SPLIT = 256  # a whole number of BLOCK_N tiles
MAX_SPLITS = 32


# Arguments that change from step to step are not specialised on (value 1, divisibility by 16): each new value
# would compile a new variant in the middle of a run. See triton_aot.py, which counts the variants a run needs.
# `window` is fixed per layer, but not specialised either: one variant serves a model's windowed and full layers.
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
                         out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
                         scale_log2, window,
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                         stride_sb, stride_ss,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
                         SPLIT: tl.constexpr, WIDEN_DOT: tl.constexpr, KV_INT8: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    visible = tl.where(window > 0, tl.minimum(seq_len, window), seq_len)  # visible_len()
    # split_size() of this sequence's visible length, the splits laid from its first visible key
    split_size = tl.maximum(tl.cdiv(tl.cdiv(visible, BLOCK_N), num_splits), MIN_SPLIT_TILES) * BLOCK_N
    start = seq_len - visible + split * split_size
    end = tl.minimum(start + split_size, seq_len)  # start >= end: an empty split (short sequence), no tiles

    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if not KV_INT8:  # an int8 cache's tiles are converted to q's dtype instead
        q = q.to(k_cache_ptr.dtype.element_ty)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores, log2 domain
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block, in_block = paged_slots(table, pos, pos_ok, BLOCK_SIZE)
        k, k_scale = load_kv_tile(k_cache_ptr, k_scale_ptr, block, in_block, kv_head, stride_kb, stride_ks,
                                  stride_kh, stride_sb, stride_ss, dims, pos_ok, dim_ok, q, KV_INT8)
        scores = dot(q, tl.trans(k), WIDEN_DOT) * scale_log2
        if KV_INT8:
            scores = scores * k_scale[None, :]
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        v, v_scale = load_kv_tile(v_cache_ptr, v_scale_ptr, block, in_block, kv_head, stride_vb, stride_vs,
                                  stride_vh, stride_sb, stride_ss, dims, pos_ok, dim_ok, q, KV_INT8)
        m, l, acc = online_softmax_update(scores, m, l, acc, v, v_scale, WIDEN_DOT, KV_INT8)

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        part = (seq * num_q_heads + heads) * num_splits + split
        tl.store(part_max_ptr + part, m, mask=row_ok)
        tl.store(part_sum_ptr + part, l, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # l == 0 only for an empty (padding) sequence
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, num_splits,
                          stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One program per (sequence, query head): rescale each split's partial to the global max and sum them."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    part = (seq * num_q_heads + head) * num_splits + splits
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # an empty sequence (padding): every weight is 0
    weight = tl.exp2(m - m_all)  # empty splits have m = -inf: weight 0
    total = tl.sum(l * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The device's SMs; 8 off CUDA (the interpreter, in tests; meta tensors, in triton_aot)."""
    return _num_sms(device) if device.type == "cuda" else 8


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int, window: int | None = None) -> int:
    """Enough splits to give every SM about two programs, but no more than a max_seq_len-token context (or a
    window of fewer tokens) can fill with MIN_TOKENS_PER_SPLIT tokens each, and at most MAX_SPLITS."""
    wanted = triton.cdiv(2 * sms, num_seqs * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(visible_len(max_seq_len, window), MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def visible_len(seq_len: int, window: int | None) -> int:
    """The keys a sequence's next token sees: its last `window` (all of them without a window)."""
    return seq_len if window is None or window <= 0 else min(seq_len, window)


def split_size(seq_len: int, num_splits: int) -> int:
    """Context tokens per split for one sequence whose visible context (visible_len) is seq_len tokens (the kernel
    computes the same, on the device, from the real length): an even cut into num_splits, rounded up to whole
    BLOCK_N tiles and to at least MIN_TOKENS_PER_SPLIT; the splits past the sequence's end do nothing."""
    tiles = triton.cdiv(triton.cdiv(seq_len, BLOCK_N), num_splits)
    return max(tiles, MIN_TOKENS_PER_SPLIT // BLOCK_N) * BLOCK_N


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int, scale: float, out: torch.Tensor | None = None,
                 num_splits: int | None = None, window: int | None = None,
                 kv_scales: KVScales | None = None) -> torch.Tensor:
    """One query token per sequence ([B, Hq, D]) against its paged context of seq_lens[b] tokens (its last `window`
    of them under a sliding window) → [B, Hq, D]. An int8 cache comes with its `kv_scales`.

    The grid comes from B, max_seq_len and the window alone (no device reads), so a CUDA graph captured with a large
    max_seq_len serves any shorter contexts; each sequence's cut into splits follows its real length.
    """
    batch, q_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(batch, k_cache.shape[2], max_seq_len, num_sms(q.device), window)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    partials = decode_partials(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, window, kv_scales)
    if partials is not None:
        part_max, part_sum, part_acc = partials
        head_dim_pad = triton.next_power_of_2(head_dim)
        # SPLITS_PAD is MAX_SPLITS whatever num_splits is: one compiled variant for every split count
        _decode_reduce_kernel[(batch, q_heads)](
            out, part_max, part_sum, part_acc, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=MAX_SPLITS)
    return out


def decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, out: torch.Tensor, num_splits: int,
                    window: int | None = None,
                    kv_scales: KVScales | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The split kernel's launch. With one split it writes the output itself and returns None; with several it
    returns each (sequence, query head, split)'s running max, sum ([B, Hq, splits]) and output ([B, Hq, splits, D])
    for the reduction (an empty split has max -inf)."""
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    split = num_splits > 1
    if split:
        part_max = torch.empty((batch, q_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((batch, q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # unused
    k_scale, v_scale, stride_sb, stride_ss, kv_int8 = kv_scale_args(k_cache, kv_scales)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, out, part_max, part_sum, part_acc,
        scale * LOG2E, kernel_window(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), stride_sb, stride_ss,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs 16 rows at least
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        MIN_SPLIT_TILES=MIN_TOKENS_PER_SPLIT // BLOCK_N, SPLIT=split,
        WIDEN_DOT=dot_needs_fp32(q.dtype if kv_int8 else k_cache.dtype), KV_INT8=kv_int8,
        **unpipelined_for_fp32(kv_int8, q.dtype))
    return (part_max, part_sum, part_acc) if split else None
