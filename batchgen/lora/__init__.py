"""LoRA adapters over a shared base model: read and checked against the base model (adapter.py), applied per row
in a batch (lora_linear.py), attached to the engine's model at start-up and kept resident up to max_loras at once
(attach.py: EngineArgs.lora, Request.lora; the job file's `lora:` map and `input.lora_column`)."""
from .adapter import AdapterError, BaseShape, LoraAdapter, read_adapter
from .lora_linear import LoraContext, LoraLinear

__all__ = ["AdapterError", "BaseShape", "LoraAdapter", "LoraContext", "LoraLinear", "read_adapter"]
