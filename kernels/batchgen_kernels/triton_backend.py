"""The CUDA attention backend: the reference's interface (`store_kv`, `paged_attention`) on Triton kernels.

Importing this module requires Triton; `get_backend` falls back to the torch reference when it is missing.
Under TRITON_INTERPRET=1 (set before the first import) the same kernels run on CPU tensors, which is how CI tests them.
"""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata
from .reference import KVScales
from .triton_decode import paged_decode
from .triton_prefill import paged_prefill
from .triton_store import store_kv

__all__ = ["paged_attention", "paged_decode", "paged_prefill", "store_kv"]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, window: int | None = None, kv_scales: KVScales | None = None) -> torch.Tensor:
    """Attention for a whole varlen step ([T, Hq, D]): one decode launch (plus its split reduction) for the
    first md.num_decodes sequences, one prefill launch for the rest. Reads nothing back from the device. Under a
    sliding window each query sees its last `window` keys (the kernels take it as a runtime argument). An int8
    cache (with its `kv_scales`) is read as int8: the kernels fold the scales in."""
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    out = torch.empty_like(q)
    nd = md.num_decodes
    if nd:
        paged_decode(q[:nd], k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd], md.max_seq_len, scale,
                     out=out[:nd], window=window, kv_scales=kv_scales)
    if md.num_seqs > nd:
        paged_prefill(q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, first_seq=nd,
                      num_seqs=md.num_seqs - nd, max_query_len=md.max_query_len, scale=scale, out=out, window=window,
                      kv_scales=kv_scales)
    return out
