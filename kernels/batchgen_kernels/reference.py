"""Paged attention in plain torch ops: the CPU path and the oracle every other kernel is tested against.

Cache layout (per layer): k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim]. An int8 cache
(engine.kv_cache_dtype: int8) comes with `kv_scales`, its K and V scales [num_blocks, block_size, num_kv_heads] (fp32,
one per token and kv head: x ~= int8 x scale); the functions here dequantize only the blocks they gather.
`window` (a sliding-window layer, e.g. Gemma 3's local layers): the query at position p sees only the keys at
positions p - window + 1 .. p; None sees the whole causal context.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


KVScales = tuple[torch.Tensor, torch.Tensor]  # an int8 cache's K and V scales, [num_blocks, block_size, Hkv] each


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H, D] → int8 [T, H, D] and fp32 scales [T, H]: symmetric per row, scale = absmax / 127, the value
    round(x x 127 / absmax) (the C++ store's own fp32 arithmetic, so both store the same bits)."""
    x = x.float()
    absmax = x.abs().amax(dim=-1)
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, 0.0)  # a true division (127.0 / t is not)
    return torch.round(x * inv[..., None]).to(torch.int8), absmax / 127.0


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """Write the new tokens' K/V ([T, Hkv, D]) into their cache slots (quantized, with kv_scales: an int8 cache)."""
    num_blocks, block_size, heads, dim = k_cache.shape
    if kv_scales is not None:
        for x, cache, scales in ((key, k_cache, kv_scales[0]), (value, v_cache, kv_scales[1])):
            q, scale = quantize_kv(x)
            cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, q)
            scales.view(num_blocks * block_size, heads).index_copy_(0, slot_mapping, scale)
        return
    k_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int, first_block: int = 0,
            scale: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's cached tokens from block `first_block` up to token `length`: [length - first_block x
    block_size, Hkv, D] (fp32, dequantized by `scale`: an int8 cache). Table entries before first_block are not
    read."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return _blocks(cache, block_table[first_block:num_blocks], scale).flatten(0, 1)[:length - first_block * block_size]


def _blocks(cache: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """cache[table], dequantized to fp32 where `scale` is an int8 cache's."""
    return cache[table] if scale is None else cache[table].float() * scale[table][..., None]


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int, scale: float, window: int | None = None,
                 kv_scales: KVScales | None = None) -> torch.Tensor:
    """One query token per sequence ([B, Hq, D]) against its whole paged context, all sequences at once: gather the
    batch's blocks (up to the longest context) and mask each sequence's tail."""
    batch, q_heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    if window is not None and max_seq_len > window:
        width = min(num_blocks, window // block_size + 2)  # the most blocks a window's keys straddle
        table, keys = _window_blocks(block_tables, seq_lens, window, block_size, width)
    else:
        table = block_tables[:, :num_blocks]
        keys = torch.arange(num_blocks * block_size, device=q.device)[None, :]
    k_scale, v_scale = kv_scales or (None, None)
    k = _blocks(k_cache, table, k_scale).flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    v = _blocks(v_cache, table, v_scale).flatten(1, 2).transpose(1, 2)
    qg = q.view(batch, kv_heads, q_heads // kv_heads, dim)  # the query heads that share each KV head
    visible = keys < seq_lens[:, None]
    if window is not None:
        visible &= keys >= seq_lens[:, None] - window
    out = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=visible[:, None, None, :],
                                         scale=scale)
    return out.reshape(batch, q_heads, dim)


def _window_blocks(block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int, block_size: int,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` table entries from the block of its window's first key (an engine may have freed the
    blocks before it), never past its own last block (a shorter row repeats that one, masked), and the position
    of every key they hold: ([B, width] block ids, [B, width x block_size] positions)."""
    lens = seq_lens.long()
    first = (lens - window).clamp(min=0) // block_size
    last = ((lens + block_size - 1) // block_size - 1).clamp(min=0)
    index = first[:, None] + torch.arange(width, device=lens.device)[None, :]
    table = block_tables.gather(1, torch.minimum(index, last[:, None]))
    keys = (first * block_size)[:, None] + torch.arange(width * block_size, device=lens.device)[None, :]
    return table, keys


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_len: int, scale: float, window: int | None = None,
                  kv_scales: KVScales | None = None) -> torch.Tensor:
    """The last q.shape[0] tokens of one sequence ([Tq, Hq, D]) attend causally to its seq_len cached tokens."""
    q_len, q_heads, dim = q.shape
    if window is not None and seq_len > window:
        return _windowed_prefill(q, k_cache, v_cache, block_table, seq_len, scale, window, kv_scales)
    k_scale, v_scale = kv_scales or (None, None)
    k = _gather(k_cache, block_table, seq_len, scale=k_scale).to(q.dtype)
    v = _gather(v_cache, block_table, seq_len, scale=v_scale).to(q.dtype)
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    if q_len == seq_len or q.dtype == torch.float32:
        # torch's flash kernel (4-D inputs: 3-D ones take SDPA's slow math path, 4.4x slower at 1,024 tokens). After
        # a cached prefix, query j sits at absolute position seq_len - q_len + j and sees keys up to there (a mask).
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = None
        if q_len != seq_len:
            rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=mask, is_causal=mask is None, scale=scale)
        return out[0].transpose(0, 1)
    # 16-bit after a cached prefix: two batched matmuls per KV head (its query heads stacked) beat the masked flash
    # kernel ~2x on the CPU (dev/microbench_attention.py prefill); in fp32 (MKL's bmm) it is the other way round.
    qg = q.view(q_len, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, dim)
    scores = torch.bmm(qg, k.permute(1, 2, 0)).mul_(scale).view(kv_heads, group, q_len, seq_len)
    rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
    hidden = torch.arange(seq_len, device=q.device)[None, :] > rows
    probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1).view(kv_heads, group * q_len, seq_len)
    out = torch.bmm(probs, v.transpose(0, 1)).view(kv_heads, group, q_len, dim)
    return out.permute(2, 0, 1, 3).reshape(q_len, q_heads, dim)


def _windowed_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_len: int, scale: float, window: int, kv_scales: KVScales | None = None) -> torch.Tensor:
    """paged_prefill under a sliding window: only the keys some query can see are gathered (from the first
    query's window start), and each query row is masked to its own window."""
    q_len, q_heads, dim = q.shape
    first = max(seq_len - q_len - window + 1, 0)  # the oldest key the first query sees
    skip = first // k_cache.shape[1]  # the blocks wholly before it are not read (an engine may have freed them)
    offset = first - skip * k_cache.shape[1]
    k_scale, v_scale = kv_scales or (None, None)
    k = _gather(k_cache, block_table, seq_len, skip, k_scale)[offset:].to(q.dtype)
    v = _gather(v_cache, block_table, seq_len, skip, v_scale)[offset:].to(q.dtype)
    group = q_heads // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
    keys = torch.arange(first, seq_len, device=q.device)[None, :]
    mask = (keys <= rows) & (keys > rows - window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, window: int | None = None, kv_scales: KVScales | None = None) -> torch.Tensor:
    """Attention for a whole varlen step ([T, Hq, D]): the decodes batched together, prefills one by one."""
    out = torch.empty_like(q)
    for group in md.decode_groups:
        rows = torch.tensor(group, device=q.device)
        out[rows] = paged_decode(q[rows], k_cache, v_cache, md.block_tables[rows], md.seq_lens[rows],
                                 md.seq_lens_cpu[group[-1]], scale, window, kv_scales)
    paged_prefills(q, k_cache, v_cache, md, scale, out, window, kv_scales)
    return out


def paged_prefills(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                   scale: float, out: torch.Tensor, window: int | None = None,
                   kv_scales: KVScales | None = None) -> None:
    """The prefill rows of a step (those after its md.num_decodes decodes) into `out`, one sequence at a time."""
    start = md.num_decodes
    for i in range(md.num_decodes, md.num_seqs):
        end = start + md.query_lens_cpu[i]
        out[start:end] = paged_prefill(q[start:end], k_cache, v_cache, md.block_tables[i], md.seq_lens_cpu[i], scale,
                                       window, kv_scales)
        start = end
