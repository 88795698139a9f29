"""Step 3's int8 KV cache case (engine.kv_cache_dtype: int8) at the model shape's attention (its query and KV heads,
its head dim), one layer: the store and a decode step of the kernels the engine runs (Triton on a GPU) over an int8
cache against the torch reference over the same cache, and that decode timed against the same decode over the bf16
cache the int8 one was quantized from. An int8 cache holds (head_dim + 4) / (2 x head_dim) of the bf16 cache's
bytes (0.53x at head_dim 64), which is what a decode step reads; `int8_over_bf16` says how much of that the kernel
turns into time. The agreement is a verdict (`ok`: the step fails without it), the times are figures."""
from __future__ import annotations

import numpy as np
import torch

from batchgen_kernels import AttentionMetadata, get_backend, reference

from .device import best_time
from .shapes import ModelShape

SHAPES = {"cuda": (32, 4096), "cpu": (2, 40)}  # (sequences, context tokens each): the GPU's, a dry run's
BLOCK_SIZE = 16
# bf16's (tests/attention_cases.py): both sides read the same int8 values, only the rounding of the arithmetic differs
TOLERANCE = dict(atol=3e-2, rtol=3e-2)


def quantized_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 copy of a [blocks, block_size, Hkv, D] cache and its scales, by the reference's rule."""
    values, scales = reference.quantize_kv(cache.flatten(0, 1))
    return values.view(cache.shape), scales.view(cache.shape[:3])


def decode_step(batch: int, context: int, device: torch.device, gen: np.random.Generator) -> AttentionMetadata:
    """A decode-only step: `batch` sequences of `context` tokens, their blocks shuffled over the cache."""
    per_seq = -(-context // BLOCK_SIZE)
    tables = gen.permutation(batch * per_seq).astype(np.int32).reshape(batch, per_seq)
    slots = tables[:, (context - 1) // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    return AttentionMetadata.build([1] * batch, [context] * batch, tables, slots, device)


def kv_int8_case(shape: ModelShape, device: torch.device, attention_backend: str, seed: int, reps: int = 20) -> dict:
    backend = get_backend(device, attention_backend)
    batch, context = SHAPES[device.type]
    md = decode_step(batch, context, device, np.random.default_rng(seed))
    torch.manual_seed(seed)
    cache_shape = (md.block_tables.numel(), BLOCK_SIZE, shape.kv_heads, shape.head_dim)
    k, v = (torch.randn(cache_shape, dtype=torch.bfloat16, device=device) for _ in range(2))
    (k8, ks), (v8, vs) = quantized_cache(k), quantized_cache(v)
    q = torch.randn(batch, shape.heads, shape.head_dim, dtype=torch.bfloat16, device=device)
    scale = shape.head_dim ** -0.5

    new_k, new_v = (torch.randn(batch, shape.kv_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
                    for _ in range(2))
    stored = [[torch.zeros_like(t) for t in (k8, v8, ks, vs)] for _ in range(2)]
    for store, (kc, vc, kcs, vcs) in zip((backend.store_kv, reference.store_kv), stored):
        store(new_k, new_v, kc, vc, md.slot_mapping, kv_scales=(kcs, vcs))
    store_identical = all(torch.equal(a, b) for a, b in zip(*stored))

    int8 = backend.paged_attention(q, k8, v8, md, scale, kv_scales=(ks, vs)).float()
    expected = reference.paged_attention(q, k8, v8, md, scale, kv_scales=(ks, vs)).float()
    exact = reference.paged_attention(q, k, v, md, scale).float()
    agrees = torch.allclose(int8, expected, **TOLERANCE)
    bf16_s = best_time(lambda: backend.paged_attention(q, k, v, md, scale), reps, device)
    int8_s = best_time(lambda: backend.paged_attention(q, k8, v8, md, scale, kv_scales=(ks, vs)), reps, device)
    tokens = batch * context
    bf16_bytes, int8_bytes = tokens * k[0, 0].numel() * 2 * 2, tokens * (k8[0, 0].numel() + 4 * shape.kv_heads) * 2
    return {"ok": store_identical and agrees, "backend": backend.__name__, "sequences": batch, "context": context,
            "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "store_identical": store_identical, "decode_agrees": agrees,
            "decode_max_abs_error": (int8 - expected).abs().max().item(),
            "decode_rel_error_vs_bf16_cache": ((int8 - exact).norm() / exact.norm()).item(),
            "bf16_s": bf16_s, "int8_s": int8_s, "int8_over_bf16": int8_s / bf16_s,
            "bf16_kv_bytes": bf16_bytes, "int8_kv_bytes": int8_bytes,
            "bf16_kv_bytes_per_s": bf16_bytes / bf16_s, "int8_kv_bytes_per_s": int8_bytes / int8_s}
