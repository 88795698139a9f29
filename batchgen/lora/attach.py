"""Adapters onto a loaded model: read and checked against its description (before the base loads, where it can be
described), then each decoder layer's projections wrapped in a LoraLinear and every adapter placed in a slot of
its own (slot 0: the base model). What a request names (`Request.lora`) becomes its sequences' slot, and a salt of
their prefix-cache keys: KV computed under one adapter is never another's (or the base's)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from batchgen.engine.sequence import BASE_MODEL, AdapterIdentity

from .adapter import BaseShape, LoraAdapter, read_adapter
from .lora_linear import LoraContext, LoraLinear

# Each wrapped projection and the adapter modules of its parts, in the order of its output columns (llama.py's
# qkv_proj and gate_up_proj are packed).
PROJECTION_PARTS = {("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"), ("self_attn", "o_proj"): ("o_proj",),
                    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"), ("mlp", "down_proj"): ("down_proj",)}


@dataclass
class LoadedAdapters:
    context: LoraContext
    identities: dict[str, AdapterIdentity] = field(default_factory=dict)  # adapter name -> slot and salt
    nbytes: int = 0  # the adapters' weights as held (the model's dtype)

    def identity(self, name: str | None) -> AdapterIdentity | None:
        """The identity of adapter `name` (None: the base model); None for a name not loaded."""
        return BASE_MODEL if name is None else self.identities.get(name)


def read_adapters(paths: dict[str, str], base: BaseShape) -> list[LoraAdapter]:
    return [read_adapter(name, Path(path), base) for name, path in paths.items()]


def attach(model: nn.Module, adapters: list[LoraAdapter], dtype: torch.dtype) -> LoadedAdapters:
    """Wrap `model`'s projections (llama.py's layout: `model.layers[i].self_attn` / `.mlp`) and load every adapter,
    slots 1, 2, ... in the order given."""
    loaded = LoadedAdapters(LoraContext())
    wrapped: list[tuple[int, tuple[str, ...], LoraLinear]] = []
    for index, layer in enumerate(model.model.layers):
        for (owner_name, name), parts in PROJECTION_PARTS.items():
            owner = getattr(layer, owner_name)
            base = getattr(owner, name, None)
            if base is None:  # a mixture of experts' MLP
                if any((index, part) in adapter.modules for adapter in adapters for part in parts):
                    raise ValueError(f"lora adapter targets {', '.join(parts)} of layer {index}, a mixture of "
                                     f"experts' MLP: batchgen adapts its attention only")
                continue
            lora = LoraLinear(base, loaded.context, _part_sizes(owner, name, base))
            setattr(owner, name, lora)
            wrapped.append((index, parts, lora))
    for slot, adapter in enumerate(adapters, start=1):
        for index, parts, lora in wrapped:
            lora.load(slot, [_part(adapter, index, part) for part in parts], dtype)
        salt = hashlib.blake2b(f"lora:{adapter.name}".encode(), digest_size=16).digest()
        loaded.identities[adapter.name] = AdapterIdentity(slot, salt)
    loaded.nbytes = sum(w.a.numel() * w.a.element_size() + sum(p[4].numel() * p[4].element_size() for p in w.parts)
                        for _, _, lora in wrapped for w in lora.slots.values())
    return loaded


def _part(adapter: LoraAdapter, layer: int, part: str):
    module = adapter.modules.get((layer, part))
    return None if module is None else (module.a, module.b, module.scale)


def _part_sizes(owner: nn.Module, name: str, base: nn.Module) -> list[int]:
    out_features = getattr(base, "out_features", None) or base.weight.shape[0]
    if name == "qkv_proj":
        return [owner.q_size, owner.kv_size, owner.kv_size]
    if name == "gate_up_proj":
        return [out_features // 2, out_features // 2]
    return [out_features]
