"""Attention kernels behind one small interface.

`get_backend(device, name)` returns the module whose `store_kv(key, value, k_cache, v_cache, slot_mapping)` and
`paged_attention(q, k_cache, v_cache, metadata, scale)` the model calls: the C++ kernels on the CPU (built on first
use; the torch reference where they cannot be built), Triton kernels on CUDA (when Triton is installed).
"""
from __future__ import annotations

from types import ModuleType

import torch

from . import reference
from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "get_backend", "reference"]


BACKENDS = ("auto", "torch", "triton", "cpu")


def get_backend(device: torch.device | str, name: str = "auto") -> ModuleType:
    """`torch`: the reference; `triton`: the Triton kernels (ImportError without Triton); `cpu`: the C++ kernels
    (CPU tensors only; the reference, after one warning, where they cannot be built); `auto`: Triton on CUDA when it
    is installed, the C++ kernels on the CPU when they build, else the reference."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    device_type = torch.device(device).type
    if name == "triton" or (name == "auto" and device_type == "cuda"):
        try:
            from . import triton_backend
            return triton_backend
        except ImportError:
            if name == "triton":
                raise
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        if device_type != "cpu":
            raise ValueError(f"the cpu attention backend runs on CPU tensors, not on {device_type}")
        from . import cpu_backend
        if cpu_backend.available():
            return cpu_backend
    return reference
