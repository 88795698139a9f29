"""The CPU attention backend: the reference's interface (`store_kv`, `paged_attention`) with every decode row of a
step in one call of the C++ kernel (csrc/paged_decode_cpu.cpp), which reads K/V in place instead of gathering them.
Prefills and stores are the reference's.

`get_backend` hands this module out only after `cpu_build.load()` succeeded, so torch.ops.batchgen.paged_decode
exists whenever paged_attention runs.
"""
from __future__ import annotations

import torch

from . import cpu_build
from .metadata import AttentionMetadata
from .reference import paged_prefills, store_kv

__all__ = ["available", "paged_attention", "paged_decode", "store_kv"]


def available() -> bool:
    """Whether the C++ kernels are built and loaded (building them on first call; one warning if that fails)."""
    return cpu_build.load()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence ([B, Hq, D]) against its paged context of seq_lens[i] tokens → [B, Hq, D]."""
    return torch.ops.batchgen.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention for a whole varlen step ([T, Hq, D]): one kernel call for the decodes, prefills one by one."""
    nd = md.num_decodes
    if nd == md.num_seqs:  # a decode-only step: the kernel's output is the whole answer
        return paged_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = paged_decode(q[:nd], k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd], scale)
    paged_prefills(q, k_cache, v_cache, md, scale, out)
    return out
