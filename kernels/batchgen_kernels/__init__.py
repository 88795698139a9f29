"""Attention kernels behind one small interface.

`get_backend(device, name)` returns the module whose `store_kv(key, value, k_cache, v_cache, slot_mapping)` and
`paged_attention(q, k_cache, v_cache, metadata, scale)` the model calls: the C++ kernels on the CPU (built on first
use; the torch reference where they cannot be built), Triton kernels on CUDA (where a probe kernel runs; the
reference where it does not). `choose_backend` says which, and why.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from . import reference
from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "BATCH_INVARIANT", "BackendChoice", "BackendUnavailable", "choose_backend",
           "choose_batch_invariant", "get_backend", "reference"]


BACKENDS = ("auto", "torch", "triton", "cpu")
BATCH_INVARIANT = "cpu-batch-invariant"  # the kernels batch_invariant chooses (cpu_invariant.py); not a user's name


@dataclass(frozen=True)
class BackendChoice:
    name: str  # the kernels that run: "triton", "cpu" or "torch" (the reference)
    reason: str  # why these, in a few words
    problem: str | None = None  # why the kernels asked for (or auto's first choice) cannot run here, and the fix


class BackendUnavailable(RuntimeError):
    """attention backend "triton" was asked for and cannot run here."""


def choose_backend(device: torch.device | str, name: str = "auto") -> BackendChoice:
    """Which kernels `name` means on `device`: `torch` the reference; `triton` the Triton kernels; `cpu` the C++
    kernels (CPU tensors only); `auto` Triton on CUDA, the C++ kernels on the CPU. Triton is probed first (a tiny
    kernel compiled and launched, once per device: triton_probe.py) and the C++ kernels built; where the chosen
    kernels cannot run the choice is the reference, with `problem` saying why."""
    if name == BATCH_INVARIANT:
        return choose_batch_invariant(device)
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    device = torch.device(device)
    if name == "triton" and device.type == "meta":  # shapes only (the AOT compile test): no probe can run there
        return BackendChoice("triton", "Triton kernels (meta tensors: compiled, never launched)")
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from . import triton_probe  # imports without Triton: the probe then reports the ImportError
        problem = triton_probe.problem(device)
        if problem is None:
            return BackendChoice("triton", f"Triton kernels (a probe kernel ran on {device})")
        return BackendChoice("torch", f"torch reference: Triton cannot run on {device}: {problem}", problem)
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on CPU tensors, not on {device.type}")
        from . import cpu_backend
        if cpu_backend.preferred() or (name == "cpu" and cpu_backend.available()):
            from . import amx
            return BackendChoice("cpu", "C++ CPU kernels" + (", bf16 prefill on AMX tiles" if amx.available() else ""))
        if cpu_backend.available():  # auto, built without AVX-512: torch's kernels are faster there
            return BackendChoice("torch", "torch reference: auto on a CPU without AVX-512 (the C++ attention "
                                          "kernels are slower than torch's there)")
        problem = "the C++ CPU kernels could not be built (the warning above says why)"
        return BackendChoice("torch", f"torch reference: {problem}", problem)
    return BackendChoice("torch", "torch reference: " + ("set in attention_backend" if name == "torch"
                                                         else f"auto on {device.type}"))


def choose_batch_invariant(device: torch.device | str) -> BackendChoice:
    """The kernels of batch_invariant: the C++ prefill kernel for every query row (cpu_invariant.py). Where they
    cannot run, the choice says why in `problem` (the engine refuses to start: its promise could not be kept)."""
    device = torch.device(device)
    if device.type != "cpu":
        return BackendChoice("torch", "torch reference", f"batch_invariant is implemented for the CPU only, not "
                                                         f"{device.type}: set batch_invariant: false there")
    from . import cpu_backend
    if not cpu_backend.available():
        return BackendChoice("torch", "torch reference", "batch_invariant needs the C++ CPU kernels, which could not "
                                                         "be built (the warning above says why)")
    return BackendChoice(BATCH_INVARIANT, "C++ CPU prefill kernel for every query row (batch_invariant)")


def get_backend(device: torch.device | str, name: str = "auto") -> ModuleType:
    """The module of choose_backend(device, name); BackendUnavailable when "triton" is asked for and cannot run."""
    choice = choose_backend(device, name)
    if name == "triton" and choice.name != "triton":
        raise BackendUnavailable(choice.reason)
    if choice.name == "triton":
        from . import triton_backend
        return triton_backend
    if choice.name == "cpu":
        from . import cpu_backend
        return cpu_backend
    if choice.name == BATCH_INVARIANT:
        from . import cpu_invariant
        return cpu_invariant
    return reference
