"""Our own model implementations (one Llama-family decoder) and the registry that picks one for a config."""
from .llama import LlamaForCausalLM, LlamaVariant
from .registry import SUPPORTED_ARCHITECTURES, ModelError, UnsupportedModelError, build_model, model_variant

__all__ = ["LlamaForCausalLM", "LlamaVariant", "ModelError", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError",
           "build_model", "model_variant"]
