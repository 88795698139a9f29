"""Which transformers decoders the generic path (generic.py) runs, what shape their KV cache takes, and why the
others are refused: all decided from the config and the model built on the meta device, before any weight loads.

A model can take the path when its class routes attention through transformers' attention interface
(`_supports_attention_backend`), it is a causal LM with every layer an attention layer (full or sliding-window), and
its attention is what batchgen's paged kernels compute: causal softmax attention over its own sequence, optionally in
a window, with softcapping or sinks. Every layer must share one KV shape (heads, width). Refused by name: hybrid
layers (Mamba, linear attention, convolutions), ALiBi, chunked attention, encoder-decoders.
"""
from __future__ import annotations

import copy

from dataclasses import dataclass

import torch
from torch import nn

from .generic_attention import ATTENTION_NAME, register_attention

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# model_type → why its attention is not batchgen's: configs that say so in no field of their own
_REFUSED_MODEL_TYPES = {
    "bloom": "ALiBi position biases", "mpt": "ALiBi position biases", "falcon": "ALiBi or parallel-attention "
    "variants without the attention interface", "llama4_text": "chunked attention", "llama4": "chunked attention",
}


class GenericModelRefused(ValueError):
    """The architecture cannot take the generic path: the message says what in it, by name."""


@dataclass(frozen=True)
class GenericShape:
    """A transformers decoder as batchgen's KV cache and engine see it."""

    num_layers: int  # attention layers (each its own KV)
    num_heads: int
    num_kv_heads: int
    head_dim: int  # of the cached keys (and values, padded to it)
    value_dim: int  # the values' own width (== head_dim but for MLA)
    vocab_size: int
    max_model_len: int
    layer_windows: tuple[int | None, ...]
    softcap: float | None  # attention logit softcapping (Gemma 2)
    parameters: int
    experts: int  # routed experts per MoE layer (0: dense)


def causal_lm_class(config):
    """transformers' class for the config's architecture, or GenericModelRefused saying why there is none."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    name = architectures[0] if architectures else None
    if name is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    model_class = getattr(transformers, name, None) if name else None
    if model_class is None:
        raise GenericModelRefused(f"transformers {transformers.__version__} has no model class {name!r} "
                                  f"(model_type {getattr(config, 'model_type', None)!r})")
    return model_class


def refusal(config) -> str | None:
    """Why the config's model cannot take the generic path, or None."""
    try:
        model_class = causal_lm_class(config)
    except GenericModelRefused as exc:
        return str(exc)
    name = model_class.__name__
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model; batchgen runs decoder-only models"
    if not name.endswith(("ForCausalLM", "LMHeadModel")):
        return f"{name} is not a causal language model (a *ForCausalLM class)"
    if model_type in _REFUSED_MODEL_TYPES:
        return f"{name} uses {_REFUSED_MODEL_TYPES[model_type]}, which batchgen's paged attention does not compute"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other:
        return f"{name} is a hybrid model with {', '.join(map(repr, other))} layers; batchgen runs attention layers"
    for key in ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "mamba_expand"):
        if getattr(config, key, None):
            return f"{name} is a hybrid model ({key} in its config); batchgen runs attention layers"
    if getattr(config, "attention_chunk_size", None):
        return f"{name} uses chunked attention (attention_chunk_size), which batchgen's paged attention does not compute"
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "rope") == "alibi":
        return f"{name} uses ALiBi position biases, which batchgen's paged attention does not compute"
    if not getattr(model_class, "_supports_attention_backend", False):
        return (f"{name}'s transformers code does not route attention through transformers' attention interface, "
                f"which batchgen's generic path plugs into")
    return None


def build_on_meta(config) -> nn.Module:
    """The transformers model for a copy of `config` with its attention set to batchgen's, on the meta device (the
    caller's config is left as it was: a model built from it later keeps its own attention)."""
    register_attention()
    model_class = causal_lm_class(config)
    config = copy.deepcopy(config)
    config._attn_implementation = ATTENTION_NAME
    with torch.device("meta"):
        return model_class(config)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention layers, in layer order: the modules with a layer_idx that call the attention
    interface (their class is named *Attention)."""
    found = [module for module in model.modules()
             if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int)]
    return sorted(found, key=lambda module: module.layer_idx)


def describe(model: nn.Module, config) -> GenericShape:
    """The KV shape and windows of a transformers decoder built by build_on_meta; GenericModelRefused where its
    layers do not share one."""
    name = type(model).__name__
    modules = attention_modules(model)
    if not modules:
        raise GenericModelRefused(f"{name}: no attention layer found (no *Attention module with a layer_idx)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    shapes = set()
    for module in modules:
        key_dim = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None) or \
            getattr(text, "head_dim", None) or text.hidden_size // heads
        value_dim = getattr(module, "v_head_dim", None) or key_dim
        kv_heads = _kv_heads(module, heads, key_dim)
        shapes.add((kv_heads, key_dim, value_dim))
    if len(shapes) != 1:
        raise GenericModelRefused(f"{name}: its layers differ in KV shape ({sorted(shapes)} as (kv heads, key width, "
                                  f"value width)); batchgen's KV cache has one shape for every layer")
    kv_heads, key_dim, value_dim = shapes.pop()
    windows = layer_windows(text, len(modules))
    softcap = getattr(text, "attn_logit_softcapping", None)
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or \
        getattr(text, "n_routed_experts", None) or 0
    max_len = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 2048
    return GenericShape(len(modules), heads, kv_heads, key_dim, value_dim, text.vocab_size, int(max_len), windows,
                        float(softcap) if softcap else None, sum(p.numel() for p in model.parameters()),
                        int(experts))


def _kv_heads(module: nn.Module, heads: int, key_dim: int) -> int:
    """The module's own KV head count: from its query-per-KV group size, or its k projection's width; all heads
    where it has neither (one fused q/k/v projection of a multi-head model: GPT-2, GPT-NeoX)."""
    groups = getattr(module, "num_key_value_groups", None)
    if groups:
        return heads // groups
    width = getattr(getattr(module, "k_proj", None), "out_features", None)  # nn.Linear, packed or int8
    if width:
        return width // key_dim
    return heads


def layer_windows(config, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window: config.layer_types where the config has them, else config.sliding_window for
    every layer (where use_sliding_window does not turn it off), else none."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types[:num_layers])
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return (None,) * num_layers
    return (int(window),) * num_layers
