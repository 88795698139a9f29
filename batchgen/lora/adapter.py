"""A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`), read and checked against its base
model's config before the base model loads: every way an adapter can be wrong is one AdapterError naming the
adapter and the key or tensor at fault, never a shape error in the middle of a run.

What is checked: the files exist and parse; `peft_type` is LORA; what batchgen does not run is refused by name (DoRA,
trained biases, `modules_to_save`, Conv1D's `fan_in_fan_out`, an embedding or LM head target); every tensor names a
decoder layer's q/k/v/o or gate/up/down projection of a layer the base has, with the base's input and output
sizes, the rank its config gives (`r`, or `rank_pattern`), and a float dtype. The scale of each module is
`lora_alpha / r` (`alpha_pattern` and `rank_pattern` per module), or `lora_alpha / sqrt(r)` with rsLoRA, as PEFT
computes it.

The weights stay as read (fp32 here); lora_weights.py lays them out for the engine."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchgen.models.inspector import ModelDescription
from batchgen.models.safetensors_header import SafetensorsHeaderError, read_safetensors_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
REFUSED_TARGETS = ("embed_tokens", "lm_head")  # batchgen applies adapters to the decoder layers' projections only
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT's names over a *ForCausalLM)
TENSOR_NAME = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                         r"(?:\.default)?\.weight")


class AdapterError(ValueError):
    """An adapter that cannot run on this base model. `adapter` is its name in the job's `lora:` map, `key` the
    config key or tensor name at fault (None: the adapter as a whole)."""

    def __init__(self, adapter: str, message: str, key: str | None = None) -> None:
        super().__init__(f"lora adapter {adapter!r}: {message}")
        self.adapter, self.key = adapter, key


@dataclass(frozen=True)
class BaseShape:
    """What an adapter must fit: the base model's layer count and each projection's (input, output) size."""

    num_layers: int
    sizes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, description: ModelDescription) -> "BaseShape":
        """From the base model's description (models/inspector.py: describe_model, or describe_config)."""
        d = description
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        hidden, inner = d.hidden_size, d.intermediate_size
        return cls(d.num_layers, {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                                  "o_proj": (q, hidden), "gate_proj": (hidden, inner), "up_proj": (hidden, inner),
                                  "down_proj": (inner, hidden)})


@dataclass
class LoraModule:
    """One adapted projection of one layer: delta(x) = scale * (x @ a.T) @ b.T."""

    layer: int
    module: str  # q_proj, ..., down_proj
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int  # the config's r (a module may have another through rank_pattern)
    alpha: float
    rslora: bool
    target_modules: tuple[str, ...]
    modules: dict[tuple[int, str], LoraModule] = field(default_factory=dict)  # (layer, module) -> its weights

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


def read_adapter(name: str, path: Path, base: BaseShape) -> LoraAdapter:
    """The adapter in directory `path`, checked against `base`; an AdapterError at the first problem."""
    path = Path(path)
    config = _read_config(name, path)
    rank, alpha = config["r"], config["lora_alpha"]
    targets = _target_modules(name, config)
    adapter = LoraAdapter(name, path, rank, float(alpha), bool(config.get("use_rslora")), targets)
    tensors = _read_tensors(name, path / WEIGHTS_FILE)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = TENSOR_NAME.fullmatch(tensor_name)
        if match is None:
            raise AdapterError(name, f"tensor {tensor_name} is not a LoRA weight of a decoder layer's projection "
                                     f"(batchgen adapts {', '.join(TARGET_MODULES)})", tensor_name)
        layer, module, which = int(match.group(1)), match.group(3), match.group(4)
        if module not in TARGET_MODULES:
            raise AdapterError(name, f"tensor {tensor_name} adapts {module}, which batchgen does not adapt "
                                     f"(it adapts {', '.join(TARGET_MODULES)})", tensor_name)
        if layer >= base.num_layers:
            raise AdapterError(name, f"tensor {tensor_name} is for layer {layer}, but the base model has "
                                     f"{base.num_layers} layers", tensor_name)
        pairs.setdefault((layer, module), {})[which] = tensor
    in_layer_order = sorted(pairs.items(), key=lambda item: (item[0][0], TARGET_MODULES.index(item[0][1])))
    for (layer, module), pair in in_layer_order:
        adapter.modules[(layer, module)] = _module(name, config, layer, module, pair, base)
    if not adapter.modules:
        raise AdapterError(name, f"{path / WEIGHTS_FILE} holds no LoRA weights")
    return adapter


def _read_config(name: str, path: Path) -> dict:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterError(name, f"{path} is not a directory (a PEFT adapter: {CONFIG_FILE} and {WEIGHTS_FILE})")
    if not file.is_file():
        raise AdapterError(name, f"{path} has no {CONFIG_FILE}: not a PEFT adapter directory", CONFIG_FILE)
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(name, f"{file} is not JSON ({exc})", CONFIG_FILE) from None
    if not isinstance(config, dict):
        raise AdapterError(name, f"{file} is not a JSON object", CONFIG_FILE)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(name, f"peft_type is {config['peft_type']!r}; batchgen runs LoRA adapters", "peft_type")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise AdapterError(name, f"{key} must be a positive number, got {value!r}", key)
    if int(config["r"]) != config["r"]:
        raise AdapterError(name, f"r must be an integer, got {config['r']!r}", "r")
    refused = [("use_dora", bool(config.get("use_dora")), "DoRA (use_dora: true) is not supported"),
               ("bias", config.get("bias", "none") not in (None, "none"),
                f"trained biases (bias: {config.get('bias')!r}) are not supported; only bias: none"),
               ("modules_to_save", bool(config.get("modules_to_save")),
                f"modules_to_save {config.get('modules_to_save')!r}: fully trained modules are not supported"),
               ("fan_in_fan_out", bool(config.get("fan_in_fan_out")),
                "fan_in_fan_out (Conv1D layers, GPT-2 style) is not supported")]
    for key, bad, message in refused:
        if bad:
            raise AdapterError(name, message, key)
    return config


def _target_modules(name: str, config: dict) -> tuple[str, ...]:
    targets = config.get("target_modules")
    if isinstance(targets, str):  # "all-linear", or a regex over the modules' full names (PEFT's fullmatch)
        return tuple(t for t in TARGET_MODULES if targets == "all-linear" or re.fullmatch(targets, t) or
                     re.fullmatch(targets, f"model.layers.0.{'mlp' if t in MLP_MODULES else 'self_attn'}.{t}"))
    if not isinstance(targets, list) or not targets:
        raise AdapterError(name, f"target_modules must be a non-empty list, got {targets!r}", "target_modules")
    for target in targets:
        if target in REFUSED_TARGETS:
            raise AdapterError(name, f"target module {target} is not supported: batchgen adapts the decoder "
                                     f"layers' projections ({', '.join(TARGET_MODULES)})", "target_modules")
        if target not in TARGET_MODULES:
            raise AdapterError(name, f"target module {target!r} is not one batchgen adapts "
                                     f"({', '.join(TARGET_MODULES)})", "target_modules")
    return tuple(targets)


def _read_tensors(name: str, file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise AdapterError(name, f"{file} is missing (batchgen reads safetensors adapters)", WEIGHTS_FILE)
    try:
        header = read_safetensors_header(file)
    except (SafetensorsHeaderError, OSError) as exc:
        raise AdapterError(name, f"{file} is not a readable safetensors file ({exc})", WEIGHTS_FILE) from None
    size = file.stat().st_size
    for tensor_name, entry in header.entries.items():
        if entry.get("dtype") not in FLOAT_DTYPES:
            raise AdapterError(name, f"tensor {tensor_name} is {entry.get('dtype')}; adapters must be F32, F16 or "
                                     f"BF16", tensor_name)
        end = header.data_start + entry["data_offsets"][1]
        if end > size:
            raise AdapterError(name, f"{file} is cut short: tensor {tensor_name} ends at byte {end:,}, the file has "
                                     f"{size:,}", WEIGHTS_FILE)
    from safetensors.torch import load_file

    try:
        return {key: value.float() for key, value in load_file(str(file)).items()}
    except Exception as exc:  # safetensors' own checks (overlapping offsets, ...)
        raise AdapterError(name, f"{file} cannot be read: {exc}", WEIGHTS_FILE) from None


def _pattern_value(patterns: dict, layer: int, module: str, default):
    """PEFT's rank_pattern/alpha_pattern: a key matches the module's full name's end (`q_proj`, `layers.0.q_proj`,
    or a regex)."""
    full = f"model.layers.{layer}.{'mlp' if module in MLP_MODULES else 'self_attn'}.{module}"
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", full):
            return value
    return default


def _module(name: str, config: dict, layer: int, module: str, pair: dict[str, torch.Tensor],
            base: BaseShape) -> LoraModule:
    label = f"layers.{layer}.{module}"
    if set(pair) != {"A", "B"}:
        missing = "lora_B" if "A" in pair else "lora_A"
        raise AdapterError(name, f"{label} has no {missing} weight", label)
    if module not in _target_modules(name, config):
        raise AdapterError(name, f"{label} has weights, but target_modules does not name {module}", label)
    a, b = pair["A"], pair["B"]
    rank = int(_pattern_value(config.get("rank_pattern"), layer, module, config["r"]))
    alpha = float(_pattern_value(config.get("alpha_pattern"), layer, module, config["lora_alpha"]))
    size_in, size_out = base.sizes[module]
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, size_in) or tuple(b.shape) != (size_out, rank):
        raise AdapterError(name, f"{label}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}; the base model's "
                                 f"{module} takes {size_in} inputs to {size_out} outputs at rank {rank}, so they must "
                                 f"be [{rank}, {size_in}] and [{size_out}, {rank}] (an adapter of another base model?)",
                           label)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraModule(layer, module, a, b, scale)
