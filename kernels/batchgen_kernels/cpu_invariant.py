"""Batch-invariant paged attention on the CPU: every query row of a step — a decode's, a prefill's, a chunk's, one
after a cached prefix — goes through the one C++ prefill kernel (csrc/paged_prefill_cpu.cpp), decodes as one-row
prefills.

Why that kernel: its arithmetic for a query row depends only on the row's position and its keys. Each row's keys are
taken in tiles that start at the sequence's first key (position 0, or its window's start), scored by multiply-adds
over head_dim in order, and reduced by one thread, so the row comes out bit-identical whichever rows share its call,
however its prompt was chunked, whether its prefix came from the cache, and at any thread count (measured on the
rows of a 1,024-token prompt: at once, in two chunks at 16/100/517/1,000, each row alone, 1 and 2 threads). The
decode kernel (csrc/paged_decode_cpu.cpp) sums its dot products in another order (a transposing tree), so a token
decoded and the same token recomputed as a prefill after a preemption would differ; the torch reference differs
with the batch's padding and the flash kernel's split sizes. The AMX prefill kernel is not used: its tiles were not
measured for this. Stores are the reference's (an int8 cache's: the C++ quantizing store, and its prefill kernel's
int8 entry, the same tiles over rows dequantized as they are packed).
"""
from __future__ import annotations

import torch

from . import cpu_backend
from .cpu_backend import store_kv
from .metadata import AttentionMetadata, kernel_window
from .reference import KVScales

__all__ = ["available", "paged_attention", "store_kv"]


def available() -> bool:
    return cpu_backend.available()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, window: int | None = None, kv_scales: KVScales | None = None) -> torch.Tensor:
    """Attention for a whole varlen step ([T, Hq, D]), every sequence as a prefill of its query rows."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q is in the cache's dtype: the model's
    if kv_scales is not None:
        torch.ops.batchgen.paged_prefill_int8_(q, k_cache, v_cache, *kv_scales, md.block_tables, md.seq_lens,
                                               md.query_start_loc, 0, scale, kernel_window(window), out)
        return out
    torch.ops.batchgen.paged_prefill_(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0,
                                      scale, kernel_window(window), out)
    return out
