"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM) over a flat, unpadded batch of tokens.

Numerics follow transformers' implementation (RMSNorm in fp32 then cast, rotate-half RoPE from fp32 tables) so
that greedy outputs match it. Q/K/V and gate/up are each one fused Linear: fewer, larger matmuls; the loader
concatenates the checkpoint's separate weights into them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from batchgen_kernels import AttentionMetadata
from batchgen_kernels.elementwise import TorchElementwise

from .attention import Attention


@dataclass(frozen=True)
class LlamaVariant:
    """What sets one Llama-family architecture apart from another (chosen by the registry)."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    qk_norm_whole: bool = False  # OLMoE: the q and k norms span the whole projection, not each head
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to +-clip_qkv after the norms
    tie_word_embeddings: bool = False
    num_labels: int = 0  # a *ForSequenceClassification checkpoint: its `score` head's outputs (0: none)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchElementwise.rms_norm(x, self.weight, self.eps)


def rope_parameters(config) -> dict:
    """The RoPE settings as one dict with `rope_type` and `rope_theta`, from a transformers v4 or v5 config."""
    params = getattr(config, "rope_parameters", None)  # v5
    if params is None:  # v4: rope_theta beside an optional rope_scaling dict
        params = {**(getattr(config, "rope_scaling", None) or {}), "rope_theta": config.rope_theta}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (fp32, CPU), computed exactly as transformers does."""
    return inv_freq_of(rope_parameters(config), head_dim)


def inv_freq_of(params: dict, head_dim: int) -> torch.Tensor:
    """The inverse frequencies of one RoPE setting (`rope_type`, `rope_theta` and the type's own keys)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"unsupported RoPE type {rope_type!r} (rope_scaling / rope_parameters); "
                         f"supported: 'default', 'linear', 'llama3'")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, params)
    elif rope_type == "linear":  # positions divided by `factor`
        inv_freq = inv_freq / params["factor"]
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's frequency rescaling: long wavelengths divided by `factor`, short ones kept, smooth in between."""
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim / 2] in fp32, computed once (always on the CPU first, so that a
    model built on the `meta` device still has real tables); the elementwise ops' rope_qk indexes them by position."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)


class SelfAttention(nn.Module):
    """Fused Q/K/V, optional per-head q/k norms before RoPE, paged attention, the output projection: the one attention
    of every architecture (gemma3.py's too), whose differences are arguments: the biases, the q/k norm's class
    (Qwen3's RMSNorm, Gemma's (1 + w) one) and its span (each head, or OLMoE's whole projection), OLMoE's clamp,
    the scale (default 1/sqrt(head_dim)) and the layer's sliding window. The RoPE table is forward's argument: the
    caller picks it per layer kind."""

    def __init__(self, config, head_dim: int, num_kv_heads: int, *, qkv_bias: bool = False, o_proj_bias: bool = False,
                 qk_norm: Callable[[int, float], nn.Module] | None = None, qk_norm_whole: bool = False,
                 clip_qkv: float | None = None, scale: float | None = None, sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_proj_bias)
        self.qk_norm_whole = qk_norm_whole
        self.clip_qkv = clip_qkv
        if qk_norm is not None:
            self.q_norm = qk_norm(self.q_size if qk_norm_whole else head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm(self.kv_size if qk_norm_whole else head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, num_kv_heads, head_dim,
                              scale=head_dim ** -0.5 if scale is None else scale, sliding_window=sliding_window)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, md: AttentionMetadata,
                ops) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None or self.clip_qkv is not None:  # before RoPE: then laid out as one row again
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.q_norm is not None and self.qk_norm_whole:
                q, k = self.q_norm(q), self.k_norm(k)
            elif self.q_norm is not None:
                q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.q_size)
                k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.kv_size)
            if self.clip_qkv is not None:
                q, k, v = (part.clamp(-self.clip_qkv, self.clip_qkv) for part in (q, k, v))
            qkv = torch.cat((q, k, v), dim=-1)
        q, k = ops.rope_qk(qkv, positions, rope.cos, rope.sin, self.num_heads, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, md)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config, variant: LlamaVariant, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=variant.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=variant.mlp_bias)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Attention and an MLP: the dense SwiGLU, or the `mlp` given (a sparse mixture of experts: moe.py)."""

    def __init__(self, config, variant: LlamaVariant, head_dim: int, num_kv_heads: int,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, head_dim, num_kv_heads, qkv_bias=variant.qkv_bias,
                                       o_proj_bias=variant.o_proj_bias, qk_norm=RMSNorm if variant.qk_norm else None,
                                       qk_norm_whole=variant.qk_norm_whole, clip_qkv=variant.clip_qkv)
        self.mlp = MLP(config, variant) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, normed: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                md: AttentionMetadata, next_norm: RMSNorm, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the residual stream; normed: it through this layer's input norm (the previous layer fused that
        in). Returns the new residual stream and it through `next_norm` (the next layer's input norm, or the final
        norm): each residual add is fused with the norm that follows it."""
        attn = self.self_attn(normed, positions, rope, md, ops)
        hidden, normed = ops.add_rms_norm(attn, hidden, self.post_attention_layernorm.weight,
                                          self.post_attention_layernorm.eps)
        return ops.add_rms_norm(self.mlp(normed, ops), hidden, next_norm.weight, next_norm.eps)


def uninitialized_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An embedding whose table the checkpoint fills: its default init (normal_) on the meta device would import
    torch._dynamo, 2.6 s of every start-up."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


class LlamaModel(nn.Module):
    """The decoder stack; parameter names mirror transformers' (`model.layers.N....`) except the fused projections."""

    def __init__(self, config, variant: LlamaVariant, head_dim: int, num_kv_heads: int,
                 layer_mlp: Callable[[int], nn.Module | None] = lambda layer: None) -> None:
        super().__init__()
        self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, variant, head_dim, num_kv_heads, layer_mlp(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def attention_heads(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers config, as the model is built from it."""
    heads = config.num_attention_heads
    return (heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


class CausalLM(nn.Module):
    """What the engine, the loader, packing and int8 use of a decoder, shared by every architecture (this file's and
    gemma3.py's): a subclass sets `variant`, `num_layers`, `model` (`embed_tokens`, `layers[i].self_attn.attn`),
    `lm_head` and `ops`, and defines forward and compute_logits."""

    def add_classifier(self, config) -> None:
        """A sequence-classification checkpoint's head (`score`: hidden -> num_labels, no bias), read by
        engine/pooler.py on the last token's final hidden state."""
        if self.variant.num_labels:
            self.score = nn.Linear(config.hidden_size, self.variant.num_labels, bias=False)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection when the variant says so (call after loading)."""
        if self.variant.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def output_head(self) -> nn.Module:
        return self.lm_head

    @property
    def head_tied(self) -> bool:
        return self.variant.tie_word_embeddings

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                      attention_backend: str = "auto") -> None:
        """Give each layer its slice of the paged KV cache (one [num_blocks, block_size, Hkv, D] tensor each) and
        the attention backend (batchgen_kernels.get_backend's names) that reads it."""
        if len(k_caches) != self.num_layers or len(v_caches) != self.num_layers:
            raise ValueError(f"need {self.num_layers} k and v caches, got {len(k_caches)} and {len(v_caches)}")
        for layer, k_cache, v_cache in zip(self.model.layers, k_caches, v_caches):
            layer.self_attn.attn.bind_kv_cache(k_cache, v_cache, attention_backend)

    def sliding_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: the whole context), which decides the engine's KV groups."""
        return [layer.self_attn.attn.sliding_window for layer in self.model.layers]

    def use_elementwise(self, ops) -> None:
        """The elementwise implementation forward runs (batchgen_kernels.elementwise: torch ops or fused kernels)."""
        self.ops = ops


class LlamaForCausalLM(CausalLM):
    def __init__(self, config, variant: LlamaVariant) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu' (SwiGLU) is implemented")
        self.config = config
        self.variant = variant
        self.num_layers = config.num_hidden_layers
        self.num_heads, self.num_kv_heads, self.head_dim = attention_heads(config)
        self.vocab_size = config.vocab_size
        self.max_model_len = _max_model_len(config)
        self.model = LlamaModel(config, variant, self.head_dim, self.num_kv_heads, self.layer_mlp)
        self.rotary_emb = RotaryEmbedding(rope_inv_freq(config, self.head_dim), config.max_position_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.add_classifier(config)
        self.ops = TorchElementwise  # see use_elementwise
        self.tie_weights()

    def layer_mlp(self, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP where it is not the dense SwiGLU (None): a subclass's (moe_models.py), built in
        __init__ with self.config and self.variant set."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] (all sequences' new tokens end to end) → final hidden states [T, hidden]."""
        ops, layers = self.ops, self.model.layers
        hidden = self.model.embed_tokens(input_ids)
        first_norm = layers[0].input_layernorm
        normed = ops.rms_norm(hidden, first_norm.weight, first_norm.eps)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            hidden, normed = layer(hidden, normed, positions, self.rotary_emb, attn_metadata, next_norm, ops)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


def _max_model_len(config) -> int:
    """max_position_embeddings, capped at the sliding window where one is in use: our attention is full attention,
    which equals sliding-window attention only while no sequence is longer than the window."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return config.max_position_embeddings
    return min(config.max_position_embeddings, window)
