"""Random PEFT LoRA adapters for a base model, written as PEFT saves one (`adapter_config.json` +
`adapter_model.safetensors`): for tests and for `batchgen bench --workload lora`, wherever no trained adapter is at
hand. A is scaled as its fan-in; B is small but random (PEFT starts it at zero), so that a wrong product shows."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .adapter import ATTENTION_MODULES, MLP_MODULES, BaseShape

TARGETS = list(ATTENTION_MODULES + MLP_MODULES)


def model_config(model):
    """A transformers config as it is, or the config of a model directory."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    return model


def write_adapter(path: Path, config, rank: int = 8, alpha: float = 16, targets=TARGETS, seed: int = 0,
                  layers=None, **extra) -> Path:
    """A random adapter in directory `path` for `config` (a Llama-style transformers config, or a model directory):
    every layer (or `layers`) and every module of `targets`, at `rank`, tensors named as PEFT names them over a
    *ForCausalLM. `extra`: more keys of adapter_config.json (rank_pattern, use_rslora, ...)."""
    from safetensors.torch import save_file

    from batchgen.models.inspector import describe_config

    config = model_config(config)
    shape = BaseShape.of(describe_config(config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers) if layers is None else layers:
        for module in targets:
            size_in, size_out = shape.sizes[module]
            owner = "mlp" if module in MLP_MODULES else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, size_in, generator=generator) / math.sqrt(size_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(size_out, rank, generator=generator) * 0.05
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
        "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": "tiny-llama", **extra}))
    return path
