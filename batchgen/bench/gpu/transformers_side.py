"""The GPU check's transformers side: its random-weight models on the device, and their static-batching
throughput (the bench's hf-static loop) on the offline workload."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from .device import synchronize
from ..hf_static import generate_all
from ..workloads import BenchRow


def build_hf_model(config_kwargs: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """transformers' Llama with its own random initialisation, on the device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**config_kwargs, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return _for_generation(model.to(device))


def checkpoint_dir(args) -> Path:
    """Where the check's model is saved, for the steps after the one that built it."""
    return Path(args.work_dir) / args.model


def bf16_model_and_checkpoint(config_kwargs: dict, model_dir: Path, device: torch.device, seed: int):
    """transformers' bf16 model with the check's random weights, its checkpoint in model_dir for the engine: the
    first step that needs them builds and saves them (whole, or not at all), the next loads that checkpoint."""
    if (model_dir / "config.json").is_file():
        return load_hf_model(model_dir, torch.bfloat16, device)
    model = build_hf_model(config_kwargs, torch.bfloat16, device, seed)
    partial = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(partial, model_dir)
    return model


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return _for_generation(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device))


def _for_generation(model):
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def hf_static_throughput(model, rows: list[BenchRow], batch_size: int, time_limit_s: float) -> dict:
    """Output tokens/s of transformers' static batching over `rows` (every row generates its max_tokens); no
    batch starts after time_limit_s."""
    synchronize(model.device)
    wall, outputs = generate_all(model, rows, batch_size, eos=None, pad=0, time_limit_s=time_limit_s)
    output_tokens = sum(len(output.token_ids) for output in outputs)
    return {"rows": len(outputs), "batch_size": batch_size, "output_tokens": output_tokens, "wall_s": wall,
            "output_tokens_per_s": output_tokens / wall, "truncated_by_time_limit": len(outputs) < len(rows)}
