"""Attention kernels behind one small interface.

`get_backend(device, name)` returns the module whose `store_kv(key, value, k_cache, v_cache, slot_mapping)` and
`paged_attention(q, k_cache, v_cache, metadata, scale)` the model calls: the torch reference on the CPU,
Triton kernels on CUDA (when Triton is installed).
"""
from __future__ import annotations

from types import ModuleType

import torch

from . import reference
from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "get_backend", "reference"]


BACKENDS = ("auto", "torch", "triton")


def get_backend(device: torch.device | str, name: str = "auto") -> ModuleType:
    """`torch`: the reference; `triton`: the Triton kernels (ImportError without Triton); `auto`: Triton on CUDA
    when it is installed, else the reference."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "triton" or (name == "auto" and torch.device(device).type == "cuda"):
        try:
            from . import triton_backend
            return triton_backend
        except ImportError:
            if name == "triton":
                raise
    return reference
