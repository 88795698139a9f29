"""Attention kernels behind one small interface.

`get_backend(device)` returns the module whose `store_kv(key, value, k_cache, v_cache, slot_mapping)` and
`paged_attention(q, k_cache, v_cache, metadata, scale)` the model calls: the torch reference on the CPU,
Triton kernels on CUDA (when Triton is installed).
"""
from __future__ import annotations

from types import ModuleType

import torch

from . import reference
from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "get_backend", "reference"]


def get_backend(device: torch.device | str) -> ModuleType:
    if torch.device(device).type == "cuda":
        try:
            from . import triton_backend
            return triton_backend
        except ImportError:
            pass
    return reference
