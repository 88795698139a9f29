"""Which checkpoint architectures we run, and how each one differs from plain Llama."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from torch import nn

from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM, LlamaVariant
from .moe_models import MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM


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
    "Qwen3MoeForCausalLM": lambda c: LlamaVariant(
        qkv_bias=bool(getattr(c, "attention_bias", False)), o_proj_bias=bool(getattr(c, "attention_bias", False)),
        qk_norm=True),
    "Qwen2MoeForCausalLM": lambda c: LlamaVariant(qkv_bias=bool(getattr(c, "qkv_bias", True))),
    "MixtralForCausalLM": lambda c: LlamaVariant(),
    "OlmoeForCausalLM": lambda c: LlamaVariant(
        qkv_bias=bool(getattr(c, "attention_bias", False)), o_proj_bias=bool(getattr(c, "attention_bias", False)),
        qk_norm=True, qk_norm_whole=True, clip_qkv=getattr(c, "clip_qkv", None)),
}

# The architectures that are not Llama's layers under a variant.
_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM, "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM, "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM}

# For configs saved without `architectures` (e.g. a bare config.save_pretrained).
_ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "gemma3_text": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                               "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                               "olmoe": "OlmoeForCausalLM"}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_VARIANTS)


NATIVE, GENERIC = "native", "generic"  # the model paths: batchgen's own implementation, or transformers' code


def native_architecture(config) -> str | None:
    """`config.architectures[0]` (or what its model_type implies) where batchgen implements it natively, else None."""
    architectures = getattr(config, "architectures", None) or []
    architecture = architectures[0] if architectures else \
        _ARCHITECTURE_OF_MODEL_TYPE.get(getattr(config, "model_type", None))
    return architecture if architecture in _VARIANTS else None


def model_path(config, model_impl: str = "auto") -> str:
    """NATIVE where batchgen implements the architecture, GENERIC where transformers' own code can run on the engine
    (generic_support.py); UnsupportedModelError saying why for the rest, before any weight loads. `model_impl`
    (EngineArgs'): "native" refuses the generic path, "transformers" takes it for a native architecture too."""
    if model_impl == "native":
        architecture_of(config)
        return NATIVE
    if native_architecture(config) is not None and model_impl != "transformers" and _builds_natively(config):
        return NATIVE
    from .generic_support import refusal

    why = refusal(config)
    if why is not None:
        architectures = getattr(config, "architectures", None) or [None]
        raise UnsupportedModelError(f"unsupported model architecture {architectures[0]!r} (model_type "
                                    f"{getattr(config, 'model_type', None)!r}): {why}")
    return GENERIC


def _builds_natively(config) -> bool:
    """Whether our implementation takes every setting of the config (a RoPE type it lacks, say, leaves the model
    to the generic path)."""
    import torch

    try:
        with torch.device("meta"):
            build_model(config)
    except ValueError:
        return False
    return True


def architecture_of(config) -> str:
    """`config.architectures[0]` (or what its model_type implies) of a natively implemented model;
    UnsupportedModelError for anything else."""
    architecture = native_architecture(config)
    if architecture is None:
        architectures = getattr(config, "architectures", None) or []
        model_type = getattr(config, "model_type", None)
        named = architectures[0] if architectures else _ARCHITECTURE_OF_MODEL_TYPE.get(model_type)
        raise UnsupportedModelError(
            f"unsupported model architecture {named!r} (model_type {model_type!r}); "
            f"supported natively: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture


def model_variant(config) -> LlamaVariant:
    """The flags for the config's architecture."""
    return replace(_VARIANTS[architecture_of(config)](config),
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def build_model(config, variant: LlamaVariant | None = None) -> nn.Module:
    """An uninitialised-weights model for `config` (build it under `torch.device("meta")` to skip allocation)."""
    model_class = _MODEL_CLASSES.get(architecture_of(config), LlamaForCausalLM)
    return model_class(config, variant or model_variant(config))
