"""vLLM's side of `bench --quantization int8`: a copy of the model as a compressed-tensors W8A8 int8 checkpoint, the
int8 format vLLM's CPU build runs (CompressedTensorsW8A8Int8 -> CPUInt8ScaledMMLinearKernel: per-channel int8
weights, each token's activations quantized to int8 on the fly, int8 x int8 through oneDNN).

Its int8 weights and scales are batchgen's own: `quantize_weight` on the weights as the run's dtype holds them, so
both systems multiply by the same int8 matrices. One difference remains: vLLM ties a tied LM head to the embedding
and cannot quantize it, so the checkpoint leaves `lm_head` in the model's dtype (`ignore`), where batchgen's int8
also quantizes the head. vLLM's CPU build has no int8 weight-only kernel (compressed-tensors W8A16 goes to
CPUWNA16LinearKernel, which takes only 4-bit weights), so `int8-weight-only` has no vLLM counterpart.

Made once per (model, dtype) under $BATCHGEN_CACHE_DIR/vllm-w8a8/ (written beside, then renamed into place)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

FORMAT_VERSION = 1  # bump when the checkpoint written changes
# The Linear weights batchgen's int8 quantizes (models/quantization.py DECODER_LINEARS), by their checkpoint names
QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
DONE = "batchgen-w8a8.json"  # written last: a directory without it is not a finished checkpoint
_INT8_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None,
              "actorder": None, "observer_kwargs": {}}
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {**_INT8_ARGS, "strategy": "channel", "dynamic": False, "observer": "minmax"},
        "input_activations": {**_INT8_ARGS, "strategy": "token", "dynamic": True, "observer": None},
        "output_activations": None}},
    "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None}


def w8a8_checkpoint(model_dir: Path, dtype: str) -> Path:
    """The W8A8 copy of `model_dir` (an HF directory) for weights held in `dtype`, made if the cache lacks it."""
    from batchgen.models.gguf_cache import writable_cache_dir

    model_dir = Path(model_dir).resolve()
    target = writable_cache_dir("vllm-w8a8") / f"{model_dir.name}-{dtype}-{source_key(model_dir, dtype)[:16]}"
    if (target / DONE).is_file():
        return target
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        write_checkpoint(model_dir, dtype, partial)
        shutil.rmtree(target, ignore_errors=True)  # an unfinished one left by a killed run
        os.rename(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def source_key(model_dir: Path, dtype: str) -> str:
    """What the copy depends on: the source's files (name, size, modification time), the dtype, this format."""
    from batchgen.models.checkpoint_files import weight_files

    key = hashlib.sha256(f"{FORMAT_VERSION}\0{dtype}\0{model_dir}".encode())
    for path in sorted([model_dir / "config.json", *weight_files(model_dir)]):
        stat = path.stat()
        key.update(f"\0{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return key.hexdigest()


def write_checkpoint(model_dir: Path, dtype: str, out: Path) -> None:
    """Every safetensors shard rewritten with its QUANTIZED weights as int8 `weight` + float32 `weight_scale`
    [out, 1]; the other tensors as they are; config.json with the quantization_config; the rest copied."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from batchgen.models.checkpoint_files import WEIGHTS_INDEX, weight_files
    from batchgen.models.quantization import quantize_weight

    out.mkdir(parents=True)
    run_dtype = getattr(torch, dtype)
    weight_map = {}
    for shard in weight_files(model_dir):
        tensors = {}
        with safe_open(str(shard), framework="pt", device="cpu") as source:
            for name in source.keys():
                tensor = source.get_tensor(name)
                if QUANTIZED.match(name):
                    q, scale = quantize_weight(tensor.to(run_dtype))  # as batchgen's loader sees the weight
                    tensors[name], tensors[f"{name}_scale"] = q, scale[:, None].contiguous()
                else:
                    tensors[name] = tensor
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
        weight_map.update({name: shard.name for name in tensors})
        del tensors
    if (model_dir / WEIGHTS_INDEX).is_file():
        index = {"metadata": {}, "weight_map": weight_map}
        (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=1))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for path in model_dir.iterdir():  # tokenizer, chat template, generation config
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", WEIGHTS_INDEX):
            shutil.copy(path, out / path.name)
    (out / DONE).write_text(json.dumps({"source": str(model_dir), "dtype": dtype, "format": FORMAT_VERSION}))
