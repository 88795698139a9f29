"""LoRA adapters over a shared base model: read and checked against the base model (adapter.py), applied per row
in a batch (lora_linear.py), attached to the engine's model at start-up (attach.py: EngineArgs.lora, Request.lora).
The job file does not take them yet (issue 42)."""
from .adapter import AdapterError, BaseShape, LoraAdapter, read_adapter
from .lora_linear import LoraContext, LoraLinear

__all__ = ["AdapterError", "BaseShape", "LoraAdapter", "LoraContext", "LoraLinear", "read_adapter"]
