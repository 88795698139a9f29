"""Adapters onto a loaded model: every adapter read and checked against the model's description (before the base
loads, where it can be described), then each decoder layer's projections wrapped in a LoraLinear of `max_loras`
slots. At most that many adapters are resident at once: `AdapterSlots.assign` puts each step's adapters in slots,
reading one that is not resident from its directory into the least recently used slot that the step does not need
(the scheduler admits no more adapters into a step than there are slots). What a request names (`Request.lora`)
becomes its sequences' AdapterIdentity: the name, and a salt of their prefix-cache keys, so that KV computed under
one adapter is never another's (or the base's)."""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from batchgen.engine.sequence import BASE_MODEL, AdapterIdentity

from .adapter import MLP_MODULES, TARGET_MODULES, BaseShape, LoraAdapter, read_adapter
from .lora_linear import LoraContext, LoraLinear

logger = logging.getLogger("batchgen.lora")

# Each wrapped projection and the adapter modules of its parts, in the order of its output columns (llama.py's
# qkv_proj and gate_up_proj are packed).
PROJECTION_PARTS = {("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"), ("self_attn", "o_proj"): ("o_proj",),
                    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"), ("mlp", "down_proj"): ("down_proj",)}


@dataclass
class AdapterSource:
    """An adapter as the engine knows it between loads: where to read it again, and what it was when checked."""

    name: str
    path: Path
    ranks: dict[tuple[int, str], int]  # (layer, module) -> its rank
    nbytes: int  # its weights as read (as the file stores them)

    @classmethod
    def of(cls, adapter: LoraAdapter) -> "AdapterSource":
        return cls(adapter.name, adapter.path, {key: m.rank for key, m in adapter.modules.items()}, adapter.nbytes())


class AdapterSlots:
    """The model's LoraLinears and which adapter each of their slots holds (least recently used first)."""

    def __init__(self, context: LoraContext, wrapped: list[tuple[int, tuple[str, ...], LoraLinear]],
                 sources: dict[str, AdapterSource], base: BaseShape, num_slots: int) -> None:
        self.context = context
        self.wrapped = wrapped
        self.sources = sources
        self.base = base
        self.num_slots = num_slots
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter name -> slot, least recently used first
        self.num_loads = 0  # adapters read into a slot, the first ones included

    @property
    def nbytes(self) -> int:
        """The slots' weights as held, whatever they hold: the adapters' memory bound."""
        return sum(t.numel() * t.element_size() for _, _, lora in self.wrapped for t in (lora.a, lora.b))

    def identity(self, name: str | None) -> AdapterIdentity | None:
        """The identity of adapter `name` (None: the base model); None for a name not in EngineArgs.lora."""
        if name is None:
            return BASE_MODEL
        if name not in self.sources:
            return None
        return AdapterIdentity(name, hashlib.blake2b(f"lora:{name}".encode(), digest_size=16).digest())

    def assign(self, names: set[str]) -> dict[str, int]:
        """Slots for a step's adapters (at most num_slots of them), reading those not resident."""
        if len(names) > self.num_slots:
            raise RuntimeError(f"a step of {len(names)} adapters, {self.num_slots} slots")
        for name in names:
            if name in self.resident:
                self.resident.move_to_end(name)
        for name in names:
            if name not in self.resident:
                self.load(name, self._free_slot(names))
        return {name: self.resident[name] for name in names}

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self.resident.values())
        free = [slot for slot in range(1, self.num_slots + 1) if slot not in used]
        if free:
            return free[0]
        victim = next(name for name in self.resident if name not in keep)
        return self.resident.pop(victim)

    def load(self, name: str, slot: int, adapter: LoraAdapter | None = None) -> None:
        if adapter is None:
            adapter = read_adapter(name, self.sources[name].path, self.base)
            logger.info("lora: adapter %r read into slot %d", name, slot)
        for index, parts, lora in self.wrapped:
            lora.load(slot, [_part(adapter, index, part) for part in parts])
        self.resident[name] = slot
        self.num_loads += 1


@dataclass
class CheckedAdapters:
    """Every adapter of EngineArgs.lora read and checked; the weights of the first max_loras kept to load first."""

    sources: dict[str, AdapterSource]
    first: list[LoraAdapter]


def read_adapters(paths: dict[str, str], base: BaseShape, max_loras: int) -> CheckedAdapters:
    """Each adapter read and checked, one at a time: only the first max_loras stay in memory."""
    checked = CheckedAdapters({}, [])
    for name, path in paths.items():
        adapter = read_adapter(name, Path(path), base)
        checked.sources[name] = AdapterSource.of(adapter)
        if len(checked.first) < max_loras:
            checked.first.append(adapter)
    return checked


def attach(model: nn.Module, checked: CheckedAdapters, base: BaseShape, dtype: torch.dtype,
           device: torch.device) -> AdapterSlots:
    """Wrap `model`'s projections in LoraLinears of one slot per adapter loaded first (max_loras, or fewer
    adapters), each as wide as the widest adapter needs: a native model's (llama.py's layout, q/k/v and gate/up
    packed), or on the generic path the transformers layers' own q/k/v/o and gate/up/down projections."""
    context = LoraContext()
    sources = checked.sources.values()
    num_slots = len(checked.first)
    wrapped: list[tuple[int, tuple[str, ...], LoraLinear]] = []
    for index, owner, name, parts in _projections(model):
        base_linear = getattr(owner, name, None) if owner is not None else None
        if not isinstance(base_linear, nn.Module):  # a mixture of experts' MLP, or a layer without this projection
            if any((index, part) in source.ranks for source in sources for part in parts):
                raise ValueError(f"lora adapter targets {', '.join(parts)} of layer {index}, which this model "
                                 f"does not have as such (a mixture of experts' MLP, or fused projections): "
                                 f"batchgen adapts only separate q/k/v/o and gate/up/down projections")
            continue
        rank = max(sum(s.ranks.get((index, p), 0) for p in parts) for s in sources)
        if rank == 0:  # no adapter changes this projection
            continue
        lora = LoraLinear(base_linear, context, _part_sizes(owner, name, base_linear), num_slots, rank, dtype,
                          device)
        setattr(owner, name, lora)
        wrapped.append((index, parts, lora))
    slots = AdapterSlots(context, wrapped, checked.sources, base, num_slots)
    for slot, adapter in enumerate(checked.first, start=1):
        slots.load(adapter.name, slot, adapter)
    return slots


def _projections(model: nn.Module):
    """(layer index, owning module or None, projection name, the adapter modules of its parts) of every projection
    an adapter may change."""
    from batchgen.models.generic import TransformersCausalLM

    if isinstance(model, TransformersCausalLM):  # transformers' layers: every projection its own nn.Linear
        layers = getattr(model.hf, model.hf.base_model_prefix).layers
        for index, layer in enumerate(layers):
            for module in TARGET_MODULES:
                owner = getattr(layer, "mlp" if module in MLP_MODULES else "self_attn", None)
                yield index, owner, module, (module,)
        return
    for index, layer in enumerate(model.model.layers):
        for (owner_name, name), parts in PROJECTION_PARTS.items():
            yield index, getattr(layer, owner_name), name, parts


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
