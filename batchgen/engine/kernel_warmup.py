"""Compile, at startup, every Triton kernel variant a run will launch, so that no step of the run compiles one.

Triton compiles a kernel per specialisation of its arguments. The kernels mark the arguments that change from step
to step as not specialised on (the step's number of decodes, the block table's width, the split count), and the
sliding window too (fixed per layer, but a runtime int, -1 for none: a model's local and global layers share every
variant), so a model needs five variants: store, prefill, decode with one split and with several, the splits'
reduction. Two steps of inert rows reach all five, through the model itself (so with the layouts of real steps);
tests/test_triton_aot.py checks that a realistic sequence of steps after this compiles nothing more.
"""
from __future__ import annotations

import numpy as np
import torch

from batchgen_kernels import AttentionMetadata, get_backend

from .errors import SettingError


def uses_triton(device: torch.device, attention_backend: str) -> bool:
    """Whether attention on `device` with this backend setting runs the Triton kernels."""
    try:
        backend = get_backend(device, attention_backend)
    except (ImportError, ValueError, RuntimeError):  # RuntimeError: BackendUnavailable (Triton's probe failed)
        return False
    return backend.__name__.endswith(".triton_backend")


@torch.inference_mode()
def warm_up_attention(model: torch.nn.Module, max_model_len: int) -> None:
    """Run the model on inert rows: a decode next to a two-token prefill (store, prefill, and the decode's
    several-split variant when a max_model_len context can be split), then a decode of a one-token context (the
    one-split variant). No row writes a KV slot (slot -1); the decodes read none (a context of 0 on the device, the
    lengths on the host only size the grid, as in a CUDA graph); the prefill reads block 0. Outputs are dropped."""
    device = model.device
    for host_lens, query_lens in (([max_model_len, 2], [1, 2]), ([1], [1])):
        num_tokens = sum(query_lens)
        device_lens = torch.tensor([0] + query_lens[1:], dtype=torch.int32, device=device)
        metadata = AttentionMetadata.build(query_lens, host_lens, np.zeros((len(query_lens), 1), dtype=np.int32),
                                           np.full(num_tokens, -1, dtype=np.int64), device,
                                           device_seq_lens=device_lens)
        zeros = torch.zeros(num_tokens, dtype=torch.long, device=device)
        model(zeros, zeros, metadata)


def compile_attention_kernels(model: torch.nn.Module, max_model_len: int) -> None:
    """warm_up_attention, with a kernel that does not compile or load for this model on this GPU (shared memory,
    registers, an architecture Triton cannot target) refused as a setting, before the first step."""
    from triton.errors import TritonError

    from batchgen_kernels.triton_common import triton_error_reason

    try:
        warm_up_attention(model, max_model_len)
    except TritonError as exc:
        raise SettingError("attention_backend", (
            f"the Triton attention kernels cannot run this model on this GPU ({type(exc).__name__}: "
            f"{triton_error_reason(exc)}); set attention_backend: torch")) from exc
