"""The int8 checkpoint a GGUF file is converted into (gguf_convert.py writes it, the loader reads it).

Each matrix weight of a Linear layer is stored as int8 [out, in] under its own name, with one fp32 scale per output
row under the name + SCALE_SUFFIX (models/quantization.py's layout: w ≈ q * scale). Every other tensor (the embedding,
norms, biases) is stored in fp32, the GGUF's values exactly. config.json carries INT8_CONFIG_KEY, which tells the
loader that the model is held in int8 whatever the job's `quantization` says (quantization.stored_int8_quantization
picks the activations). The loader builds each Int8Linear from the stored int8 and scales, with no float copy, and
reads the float tensors a few rows at a time when casting them (a whole fp32 copy of an 8B model's embedding would be
2 GiB beside its weights)."""
from __future__ import annotations

import torch
from torch import nn

from .quantization import Int8Linear, is_quantized
from .weight_reader import ShardReader

INT8_CONFIG_KEY = "batchgen_int8"  # config.json: {"weights": "int8", "scales": ..., "source": "gguf", ...}
SCALE_SUFFIX = "_scale"
READ_CHUNK_BYTES = 16 << 20  # a float tensor cast while read: this many bytes of its rows at a time

__all__ = ["INT8_CONFIG_KEY", "SCALE_SUFFIX", "holds_int8", "load_int8_entry_parameter", "read_int8", "stores_int8",
           "without_scales"]


def holds_int8(config) -> bool:
    """Whether a model directory's config (a transformers config or config.json's dict) is an int8 checkpoint."""
    marker = config.get(INT8_CONFIG_KEY) if isinstance(config, dict) else getattr(config, INT8_CONFIG_KEY, None)
    return marker is not None


def without_scales(shard_of: dict) -> dict:
    """The checkpoint's tensors less the scales, which belong to their weights (the loader's name check)."""
    return {name: shard for name, shard in shard_of.items() if not name.endswith(SCALE_SUFFIX)}


def load_int8_entry_parameter(model: nn.Module, param_name: str, names: list[str], shard_of: dict[str, ShardReader],
                              dtype: torch.dtype, activations: str) -> torch.Tensor | None:
    """One parameter of an int8 checkpoint, made of the checkpoint tensors `names` (concatenated along rows): an
    int8 weight replaces its Linear by an Int8Linear built from the stored int8 and scales (None is returned; the
    Linear's bias, read next, goes into it); anything else is returned at `dtype`. ValueError for a tensor that is
    not what the model expects."""
    shape = list(model.get_parameter(param_name).shape)
    stored = [shard_of[name].info(name) for name in names]
    rows = sum(part[0] if part else 1 for _, part in stored)
    if any(len(part) != len(shape) or part[1:] != shape[1:] for _, part in stored) or rows != (shape[0] if shape
                                                                                               else 1):
        raise ValueError(f"weight {param_name}: checkpoint shape {[part for _, part in stored]}, model expects "
                         f"{shape}")
    int8 = [dtype_ == torch.int8 for dtype_, _ in stored]
    if any(int8) and not all(int8):
        raise ValueError(f"weight {param_name}: its parts {names} are not all int8")
    if not any(int8):
        return _read_float(shard_of, names, shape, dtype)
    module_name = param_name.rpartition(".")[0]
    module = model.get_submodule(module_name)
    if not (param_name.endswith(".weight") and is_quantized(param_name) and isinstance(module, nn.Linear)):
        raise ValueError(f"weight {param_name} is stored in int8, but batchgen holds it in floating point")
    qweight, scale = read_int8(shard_of, names, shape)
    parent_name, _, leaf = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, Int8Linear.from_int8(qweight, scale, module.bias, activations, dtype))
    return None


def stores_int8(shard_of: dict[str, ShardReader], name: str) -> bool:
    return shard_of[name].info(name)[0] == torch.int8


def read_int8(shard_of: dict[str, ShardReader], names: list[str], shape: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weight [out, in] stored as the tensors `names` (their rows concatenated) and its fp32 scales [out]."""
    qweight = torch.empty(shape, dtype=torch.int8)
    scale = torch.empty(shape[0], dtype=torch.float32)
    row = 0
    for name in names:
        part = shard_of[name].info(name)[1]
        scale_name = name + SCALE_SUFFIX
        if scale_name not in shard_of:
            raise ValueError(f"weight {name} is stored in int8 without its scales ({scale_name})")
        scale_dtype, scale_shape = shard_of[scale_name].info(scale_name)
        if scale_dtype != torch.float32 or list(scale_shape) != [part[0]]:
            raise ValueError(f"{scale_name}: {scale_dtype} {list(scale_shape)}, expected fp32 [{part[0]}]")
        shard_of[name].read_into(name, qweight[row:row + part[0]])
        shard_of[scale_name].read_into(scale_name, scale[row:row + part[0]])
        row += part[0]
    return qweight, scale


def _read_float(shard_of: dict[str, ShardReader], names: list[str], shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The parameter at `dtype`, its parts read straight into their rows; parts of another dtype a few rows at a
    time through one small buffer."""
    out = torch.empty(shape, dtype=dtype)
    row = 0
    for name in names:
        stored_dtype, part = shard_of[name].info(name)
        target = out[row:row + part[0]] if len(names) > 1 else out
        if stored_dtype == dtype or target.dim() < 2:
            shard_of[name].read_into(name, target)
        else:
            _read_rows_cast(shard_of[name], name, target, stored_dtype)
        row += part[0] if part else 1
    return out


def _read_rows_cast(shard: ShardReader, name: str, out: torch.Tensor, stored_dtype: torch.dtype) -> None:
    row_bytes = out[0].numel() * stored_dtype.itemsize
    step = max(1, READ_CHUNK_BYTES // max(1, row_bytes))
    buffer = torch.empty((min(step, out.shape[0]), *out.shape[1:]), dtype=stored_dtype)
    start, end = shard.entries[name]["data_offsets"]
    if end - start != out.shape[0] * row_bytes:
        raise ValueError(f"{shard.path}: tensor {name} spans {end - start} bytes, its dtype and shape "
                         f"{out.shape[0] * row_bytes}")
    for first in range(0, out.shape[0], step):
        chunk = buffer[:min(step, out.shape[0] - first)]
        view = memoryview(chunk.view(-1).view(torch.uint8).numpy())
        shard.file.seek(shard.base + start + first * row_bytes)
        done = 0
        while done < len(view):
            n = shard.file.readinto(view[done:])
            if not n:
                raise ValueError(f"{shard.path}: truncated in tensor {name}")
            done += n
        out[first:first + len(chunk)].copy_(chunk)
