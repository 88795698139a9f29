"""Which checkpoint architectures we run, and how each one differs from plain Llama."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from torch import nn

from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM, LlamaVariant


class ModelError(Exception):
    """Base of every error about finding, reading or supporting a model."""


class ModelNotFoundError(ModelError):
    pass


class UnsupportedModelError(ModelError, ValueError):
    pass


# config.architectures[0] → the variant's flags, read from the config where the architecture leaves them open.
_VARIANTS: dict[str, Callable[[object], LlamaVariant]] = {
    "LlamaForCausalLM": lambda c: LlamaVariant(
        qkv_bias=bool(getattr(c, "attention_bias", False)), o_proj_bias=bool(getattr(c, "attention_bias", False)),
        mlp_bias=bool(getattr(c, "mlp_bias", False))),
    "MistralForCausalLM": lambda c: LlamaVariant(),
    "Qwen2ForCausalLM": lambda c: LlamaVariant(qkv_bias=True),
    "Qwen3ForCausalLM": lambda c: LlamaVariant(
        qkv_bias=bool(getattr(c, "attention_bias", False)), o_proj_bias=bool(getattr(c, "attention_bias", False)),
        qk_norm=True),
    "Gemma3ForCausalLM": lambda c: LlamaVariant(),  # gemma3.py builds its own layers; the variant says only tying
}

# The architectures that are not Llama's layers under a variant.
_MODEL_CLASSES: dict[str, type[nn.Module]] = {"Gemma3ForCausalLM": Gemma3ForCausalLM}

# For configs saved without `architectures` (e.g. a bare config.save_pretrained).
_ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "gemma3_text": "Gemma3ForCausalLM"}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_VARIANTS)


def architecture_of(config) -> str:
    """`config.architectures[0]` (or what its model_type implies); UnsupportedModelError for anything we do not
    implement."""
    architectures = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None)
    architecture = architectures[0] if architectures else _ARCHITECTURE_OF_MODEL_TYPE.get(model_type)
    if architecture not in _VARIANTS:
        raise UnsupportedModelError(
            f"unsupported model architecture {architecture!r} (model_type {model_type!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture


def model_variant(config) -> LlamaVariant:
    """The flags for the config's architecture."""
    return replace(_VARIANTS[architecture_of(config)](config),
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def build_model(config, variant: LlamaVariant | None = None) -> nn.Module:
    """An uninitialised-weights model for `config` (build it under `torch.device("meta")` to skip allocation)."""
    model_class = _MODEL_CLASSES.get(architecture_of(config), LlamaForCausalLM)
    return model_class(config, variant or model_variant(config))
