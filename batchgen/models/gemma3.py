"""Gemma 3 (text) over the same flat, unpadded batch as llama.py, with the same public surface (so the engine, the
loader, packing and int8 treat it alike).

What sets it apart from Llama: the embedding scaled by sqrt(hidden); RMSNorm weights centred on 0 (x * (1 + w),
the product in fp32 before the cast); four norms per layer (before and after attention and MLP); q/k norms; a
GELU-tanh gate; the attention scale 1/sqrt(query_pre_attn_scalar); and layers of two kinds (config.layer_types):
`sliding_attention` layers see only their last `sliding_window` keys and rotate with their own RoPE base
(rope_local_base_freq), `full_attention` layers see the whole context. The attention is llama.py's `SelfAttention`,
given Gemma's q/k norm, scale and each layer's window.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_kernels import AttentionMetadata
from batchgen_kernels.elementwise import TorchElementwise

from .llama import (CausalLM, LlamaVariant, RotaryEmbedding, SelfAttention, attention_heads, inv_freq_of,
                    uninitialized_embedding)

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def layer_types(config) -> list[str]:
    """Each layer's kind; older configs give a period (every Nth layer full) instead of the list."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    period = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
    return [FULL if (i + 1) % period == 0 else SLIDING for i in range(config.num_hidden_layers)]


def rope_settings(config) -> dict[str, dict]:
    """The RoPE setting of each layer kind, from a transformers v5 config (a dict per kind) or a v4 one
    (rope_theta and rope_scaling for full layers, rope_local_base_freq for sliding ones)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and FULL in params:
        return {kind: dict(params[kind]) for kind in (FULL, SLIDING)}
    full = {**(getattr(config, "rope_scaling", None) or {}), "rope_theta": config.rope_theta}
    return {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": config.rope_local_base_freq}}


class Gemma3MLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, num_kv_heads: int, sliding: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        self.kind = SLIDING if sliding else FULL  # which RoPE table the attention rotates with
        self.self_attn = SelfAttention(config, head_dim, num_kv_heads, qkv_bias=bias, o_proj_bias=bias,
                                       qk_norm=GemmaRMSNorm, scale=config.query_pre_attn_scalar ** -0.5,
                                       sliding_window=config.sliding_window if sliding else None)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, md: AttentionMetadata,
                ops) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), positions, rope, md, ops)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    """Parameter names mirror transformers' (`model.layers.N....`) except the fused projections."""

    def __init__(self, config, head_dim: int, num_kv_heads: int) -> None:
        super().__init__()
        self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, head_dim, num_kv_heads, kind == SLIDING)
                                    for kind in layer_types(config))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config, variant: LlamaVariant) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {activation!r}: only 'gelu_pytorch_tanh' is implemented")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (an encoder, not a causal LM)")
        self.config = config
        self.variant = variant
        self.num_layers = config.num_hidden_layers
        self.num_heads, self.num_kv_heads, self.head_dim = attention_heads(config)
        self.vocab_size = config.vocab_size
        self.max_model_len = config.max_position_embeddings  # sliding layers keep their window in the kernels
        self.sliding_window = config.sliding_window
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.model = Gemma3Model(config, self.head_dim, self.num_kv_heads)
        ropes = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(inv_freq_of(ropes[FULL], self.head_dim), config.max_position_embeddings)
        self.rotary_emb_local = RotaryEmbedding(inv_freq_of(ropes[SLIDING], self.head_dim),
                                                config.max_position_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.add_classifier(config)
        self.ops = TorchElementwise  # only its rope_qk: Gemma's norms and gate have numerics of their own
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] (all sequences' new tokens end to end) → final hidden states [T, hidden]."""
        embed = self.model.embed_tokens
        # the scale in the weights' dtype, as transformers rounds it (sqrt(640) in bf16 is 25.25, not 25.30)
        hidden = embed(input_ids) * torch.tensor(self.config.hidden_size ** 0.5, dtype=embed.weight.dtype)
        for layer in self.model.layers:
            rope = self.rotary_emb_local if layer.kind == SLIDING else self.rotary_emb
            hidden = layer(hidden, positions, rope, attn_metadata, self.ops)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → fp32 logits [N, vocab]."""
        logits = self.lm_head(hidden).float()
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
