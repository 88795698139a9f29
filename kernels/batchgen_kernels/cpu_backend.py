"""The CPU attention backend: the reference's interface (`store_kv`, `paged_attention`) with a step's decode rows in
one call of one C++ kernel (csrc/paged_decode_cpu.cpp) and its prefill rows in one call of another
(csrc/paged_prefill_cpu.cpp; bf16 on a CPU with AMX: csrc/amx/paged_prefill_amx.cpp, amx.py); all read K/V in place
through the block tables instead of gathering them. Stores are the reference's, but for an int8 cache
(`kv_scales`: csrc/paged_int8_cpu.cpp quantizes as it stores, its own decode kernel reads the int8 rows, and the
prefill kernels, AVX-512's or AMX's, dequantize them as they pack each work item's keys).

`get_backend` hands this module out only after `cpu_build.load()` succeeded, so the torch.ops.batchgen kernels exist
whenever paged_attention runs.
"""
from __future__ import annotations

import torch

from . import amx, cpu_build, reference
from .metadata import AttentionMetadata, kernel_window
from .reference import KVScales

__all__ = ["available", "paged_attention", "paged_decode", "paged_prefills", "preferred", "store_kv"]


def available() -> bool:
    """Whether the C++ kernels are built and loaded (building them on first call; one warning if that fails)."""
    return cpu_build.load()


def preferred() -> bool:
    """Whether `auto` should use these kernels: built, and for a CPU with AVX-512. Built for AVX2 their 16-lane
    vectors are split and spilled, and the attention kernels ran several times slower than the torch reference
    (`BATCHGEN_CPU_MARCH=x86-64-v3 BATCHGEN_CACHE_DIR=/tmp/avx2 python dev/microbench_attention.py cpu-prefill`)."""
    return available() and torch.ops.batchgen.wide_vectors()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[rows[i]] is 0 (xgrammar's packed layout), in place.
    logits: fp32 [B, V]; bitmask: int32 [B, ceil(V / 32)]; rows: int64 [R]."""
    torch.ops.batchgen.apply_token_bitmask_(logits, bitmask, rows)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    if kv_scales is None:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        torch.ops.batchgen.store_kv_int8_(key.contiguous(), value.contiguous(), k_cache, v_cache, *kv_scales,
                                          slot_mapping)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None,
                 kv_scales: KVScales | None = None) -> torch.Tensor:
    """One query token per sequence ([B, Hq, D]) against its paged context of seq_lens[i] tokens (its last `window`
    of them under a sliding window) → [B, Hq, D]."""
    if kv_scales is not None:
        return torch.ops.batchgen.paged_decode_int8(q, k_cache, v_cache, *kv_scales, block_tables, seq_lens, scale,
                                                    kernel_window(window))
    return torch.ops.batchgen.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, kernel_window(window))


def paged_prefills(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                   scale: float, out: torch.Tensor, window: int | None = None,
                   kv_scales: KVScales | None = None) -> None:
    """The prefill rows of a step (those of sequences md.num_decodes onwards) into `out` ([T, Hq, D], contiguous):
    each attends causally to its sequence's whole cached context, prefix included (or to its last `window`
    positions). The kernel takes q in the cache's dtype; any other pairing goes to the reference. bf16 runs on AMX
    tiles where amx.status() says they can."""
    if kv_scales is not None:
        kernel = torch.ops.batchgen.paged_prefill_int8_
        if q.dtype == torch.bfloat16 and amx.available():
            kernel = torch.ops.batchgen.paged_prefill_amx_int8_
        kernel(q, k_cache, v_cache, *kv_scales, md.block_tables, md.seq_lens, md.query_start_loc, md.num_decodes,
               scale, kernel_window(window), out)
        return
    if q.dtype != k_cache.dtype:
        reference.paged_prefills(q, k_cache, v_cache, md, scale, out, window)
        return
    kernel = torch.ops.batchgen.paged_prefill_
    if q.dtype == torch.bfloat16 and amx.available():
        kernel = torch.ops.batchgen.paged_prefill_amx_
    kernel(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, md.num_decodes, scale,
           kernel_window(window), out)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, window: int | None = None, kv_scales: KVScales | None = None) -> torch.Tensor:
    """Attention for a whole varlen step ([T, Hq, D]): one kernel call for the decodes, one for the prefills; under
    a sliding window each query sees its last `window` keys."""
    nd = md.num_decodes
    if nd == md.num_seqs:  # a decode-only step: the kernel's output is the whole answer
        return paged_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, scale, window, kv_scales)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = paged_decode(q[:nd], k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd], scale, window,
                                kv_scales)
    paged_prefills(q, k_cache, v_cache, md, scale, out, window, kv_scales)
    return out
