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


# A checkpoint's head, from its architecture's name and weights: what tasks it can serve (engine/startup.py).
LM_HEAD, CLASSIFIER_HEAD, NO_HEAD = "lm", "classifier", "none"
_CLASSIFIER_SUFFIX, _BASE_SUFFIX = "ForSequenceClassification", "Model"


def named_architecture(config) -> str | None:
    """`config.architectures[0]`, or what its model_type implies."""
    architectures = getattr(config, "architectures", None) or []
    return architectures[0] if architectures else _ARCHITECTURE_OF_MODEL_TYPE.get(getattr(config, "model_type", None))


def _causal_name(architecture: str) -> str:
    """The causal LM a sequence-classification or base-model class is the body of (LlamaForSequenceClassification,
    LlamaModel -> LlamaForCausalLM; Gemma3TextModel -> Gemma3ForCausalLM); other names unchanged."""
    for suffix in (_CLASSIFIER_SUFFIX, _BASE_SUFFIX):
        if architecture.endswith(suffix) and not architecture.endswith("LMHeadModel"):
            body = architecture.removesuffix(suffix)
            causal = f"{body}ForCausalLM"
            return causal if causal in _VARIANTS or not body.endswith("Text") else \
                f"{body.removesuffix('Text')}ForCausalLM"
    return architecture


def native_architecture(config) -> str | None:
    """The causal LM batchgen implements natively whose layers the config's architecture has (its own name, or the
    causal LM of a *ForSequenceClassification or base-model class), else None."""
    architecture = named_architecture(config)
    if architecture is None:
        return None
    causal = _causal_name(architecture)
    if causal != architecture and getattr(config, "text_config", None) is not None:
        return None  # a multimodal model's classifier (Gemma3ForSequenceClassification): not the text decoder's
    return causal if causal in _VARIANTS else None


def checkpoint_head(config, weight_names=None) -> str:
    """LM_HEAD, CLASSIFIER_HEAD (a `score` Linear: *ForSequenceClassification) or NO_HEAD (a base model's
    checkpoint: its class is *Model, or its weights are named without the `model.` prefix)."""
    architecture = named_architecture(config) or ""
    if architecture.endswith(_CLASSIFIER_SUFFIX):
        return CLASSIFIER_HEAD
    base_class = architecture.endswith(_BASE_SUFFIX) and not architecture.endswith("LMHeadModel")  # GPT2LMHeadModel
    if base_class or (weight_names is not None and base_model_layout(weight_names)):
        return NO_HEAD
    return LM_HEAD


def base_model_layout(weight_names) -> bool:
    """Whether a checkpoint was saved from a base model class (Qwen3Model): `embed_tokens.weight`, not
    `model.embed_tokens.weight`."""
    return "embed_tokens.weight" in weight_names and "model.embed_tokens.weight" not in weight_names


# What each task needs of a checkpoint's head (embed reads the final hidden states, which every decoder has).
_TASK_HEADS = {"generate": (LM_HEAD,), "score": (LM_HEAD,), "classify": (CLASSIFIER_HEAD,),
               "embed": (LM_HEAD, CLASSIFIER_HEAD, NO_HEAD)}
_HEAD_WORDS = {LM_HEAD: "a language-model head", CLASSIFIER_HEAD: "a sequence-classification head (`score`)",
               NO_HEAD: "no head (a base model)"}


def task_refusal(task: str, config, weight_names=None, path: str | None = None) -> str | None:
    """Why a model cannot serve `task` (the engine's), or None. `path`: NATIVE or GENERIC where known (the generic
    path runs transformers' causal LM classes: score and embed, not classify)."""
    architecture = named_architecture(config)
    head = checkpoint_head(config, weight_names)
    if head not in _TASK_HEADS.get(task, (head,)):
        needs = " or ".join(_HEAD_WORDS[h] for h in _TASK_HEADS[task])
        hint = {"classify": "; give a *ForSequenceClassification checkpoint",
                "generate": "; its task is embed" + (" or classify" if head == CLASSIFIER_HEAD else "")}.get(task, "")
        return f"task {task} needs {needs}, and {architecture} has {_HEAD_WORDS[head]}{hint}"
    if path == GENERIC and task in ("classify", "embed") and head != LM_HEAD:
        return (f"task {task} on {architecture}: it runs on the generic path (transformers' causal LM class), which "
                f"loads causal LM checkpoints only; {task} runs natively on {', '.join(SUPPORTED_ARCHITECTURES)} "
                f"(and their *ForSequenceClassification and base-model checkpoints)")
    return None


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
    """`config.architectures[0]` (or what its model_type implies) of a natively implemented model (a classifier's or
    base model's name as it is: LlamaForSequenceClassification); UnsupportedModelError for anything else."""
    _native_key(config)
    return named_architecture(config)


def _native_key(config) -> str:
    """The natively implemented causal LM the config's model is built as (native_architecture), or
    UnsupportedModelError."""
    architecture = native_architecture(config)
    if architecture is None:
        model_type = getattr(config, "model_type", None)
        raise UnsupportedModelError(
            f"unsupported model architecture {named_architecture(config)!r} (model_type {model_type!r}); "
            f"supported natively: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture


def model_variant(config) -> LlamaVariant:
    """The flags for the config's architecture."""
    num_labels = int(getattr(config, "num_labels", 0) or 0) if checkpoint_head(config) == CLASSIFIER_HEAD else 0
    return replace(_VARIANTS[_native_key(config)](config),
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), num_labels=num_labels)


def build_model(config, variant: LlamaVariant | None = None) -> nn.Module:
    """An uninitialised-weights model for `config` (build it under `torch.device("meta")` to skip allocation)."""
    model_class = _MODEL_CLASSES.get(_native_key(config), LlamaForCausalLM)
    return model_class(config, variant or model_variant(config))
