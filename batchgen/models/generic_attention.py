"""batchgen's paged attention as a transformers attention function, for the generic model path (generic.py).

transformers' decoders call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value,
attention_mask, scaling=..., **kwargs)` from each attention layer, with q/k/v after their projections, norms and
RoPE, [1, heads, tokens, head_dim]. Registered under ATTENTION_NAME, this function stores the step's keys and values
in the layer's paged KV cache and attends over each sequence's context through the engine's kernels: the engine's
flat batch of tokens goes through the model as one "sequence" of the whole step, with each token's own position, and
the step's AttentionMetadata (which token belongs to which sequence) reaches the layers through the StepContext the
model wrapper fills before each forward. No mask is built: transformers builds none for an attention name it has
no mask function for.

Softcapping (Gemma 2) and attention sinks (gpt-oss) are not in the kernels: a layer with them attends in torch over
the same paged cache (slower; correct). Keys wider than values (MLA: DeepSeek V2/V3) are cached at the keys' width,
values zero-padded to it, and the output cut back: what transformers' own cache holds for these models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from batchgen_kernels import AttentionMetadata

from .attention import Attention

ATTENTION_NAME = "batchgen_paged"


@dataclass
class StepContext:
    """The step every layer of one model attends in: set by the model's forward, read by each layer's call."""

    metadata: AttentionMetadata | None = None


@dataclass
class LayerBinding:
    """What one transformers attention module needs of batchgen: its paged attention and the model's step."""

    attention: Attention
    step: StepContext
    value_dim: int  # the values' head dim (the keys' unless MLA)
    softcap: float | None = None
    checked: bool = field(default=False)  # the first call's shapes checked against the cache's


def register_attention() -> None:
    """Make ATTENTION_NAME an attention implementation transformers' models can be built with (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature: [1, H, T, D] q, [1, Hkv, T, D] k/v → ([1, T, H, Dv], None)."""
    binding: LayerBinding = module.batchgen
    md = binding.step.metadata
    attention = binding.attention
    if not binding.checked:
        _check_call(module, binding, query, key, value, attention_mask, kwargs)
        if scaling is not None:  # the layer's own (OPT scales q itself and passes 1.0)
            attention.scale = scaling
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if v.shape[-1] != k.shape[-1]:  # MLA: values cached at the keys' width
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    sinks = kwargs.get("s_aux")
    if binding.softcap is None and sinks is None:
        out = attention(q, k, v, md)
    else:  # the int8 cache's turn of q and k (Attention) leaves the scores as they are: softcap and sinks apply
        q, k = attention.turned(q, k)
        out = _torch_attention(attention, q, k, v, md, binding.softcap, sinks)
    return out[..., :binding.value_dim].unsqueeze(0), None


def _check_call(module, binding: LayerBinding, query, key, value, attention_mask, kwargs) -> None:
    attention = binding.attention
    if query.shape[0] != 1:
        raise RuntimeError(f"{type(module).__name__}: batchgen runs one flat batch, got {query.shape[0]} rows")
    if attention_mask is not None:
        raise RuntimeError(f"{type(module).__name__}: the model built an attention mask; batchgen's paged "
                           f"attention takes none")
    heads, kv_heads = query.shape[1], key.shape[1]
    if (heads, kv_heads, key.shape[-1]) != (attention.num_heads, attention.num_kv_heads, attention.head_dim):
        raise RuntimeError(f"{type(module).__name__}: q/k heads {heads}/{kv_heads} of width {key.shape[-1]}, "
                           f"the KV cache was sized for {attention.num_heads}/{attention.num_kv_heads} of "
                           f"{attention.head_dim}")
    window = kwargs.get("sliding_window")
    if window is not None and window != attention.sliding_window:
        raise RuntimeError(f"{type(module).__name__}: the layer attends over a window of {window} tokens, "
                           f"batchgen's KV layout was made for {attention.sliding_window}")
    binding.checked = True


def _torch_attention(attention: Attention, q, k, v, md: AttentionMetadata, softcap: float | None,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's queries over its context in the paged cache, with softcapping and sinks, in fp32."""
    from batchgen_kernels.reference import _gather

    window = attention.sliding_window
    if window is not None and md.local is not None:
        md = md.local
    attention.backend.store_kv(k, v, attention.k_cache, attention.v_cache, md.slot_mapping, **attention.kv_kwargs)
    k_scale, v_scale = attention.kv_scales or (None, None)
    out = torch.empty(q.shape[0], q.shape[1], attention.head_dim, dtype=q.dtype, device=q.device)
    group = attention.num_heads // attention.num_kv_heads
    starts = md.query_start_loc.tolist()
    for i, (query_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        rows = slice(starts[i], starts[i] + query_len)
        keys = _gather(attention.k_cache, md.block_tables[i], seq_len, scale=k_scale).float()
        values = _gather(attention.v_cache, md.block_tables[i], seq_len, scale=v_scale).float()
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * attention.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = key_pos <= query_pos
        if window is not None:
            allowed &= key_pos > query_pos - window
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None:  # one more logit per head that takes probability and gives no value
            sink = sinks.float().view(-1, 1, 1).expand(-1, query_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
