"""Random-weight models of real shapes, for size, memory and speed work (tests, benches): a Hugging Face model
directory (config.json, generation_config.json, the tokenizer's files, safetensors shards and their index) that
transformers and batchgen load like the real checkpoint. Never put the weights in git: a directory inside a git
checkout is refused.

    PYTHONPATH=$PWD:$PWD/kernels python dev/make_random_model.py --shape llama-1b
    PYTHONPATH=$PWD:$PWD/kernels python dev/make_random_model.py --shape llama-8b --dry-run
    PYTHONPATH=$PWD:$PWD/kernels python dev/make_random_model.py --shape moe-1b-16x2   # the MoE bench's model

The vocabulary is the tokenizer's (default: batchgen's default model, SmolLM2's 49152 tokens), so the embedding and
LM head are smaller than the real models'. The weights are written shard by shard (at most --max-shard-gib each):
the script holds one shard at a time, never the model. Each tensor is drawn from its own generator, seeded from
(--seed, tensor name), so the values do not depend on the shard size.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchgen.models.gguf_cache import cache_root
from batchgen.models.checkpoint_files import MODEL_FILE_LIMITS, WEIGHTS_INDEX
from batchgen.models.loader import ModelError, load_tokenizer, resolve_model

_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
           "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "pretraining_tp": 1}
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
           "hidden_activation": "gelu_pytorch_tanh", "initializer_range": 0.02, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
           "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "attention_bias": False,
           "attn_logit_softcapping": None, "final_logit_softcapping": None, "tie_word_embeddings": True}
_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
            "initializer_range": 0.02, "sliding_window": None, "router_jitter_noise": 0.0}

# The real models' config.json, less the vocabulary and token ids (the tokenizer's here).
SHAPES: dict[str, dict] = {
    "llama-1b": {**_LLAMA3, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,  # Llama-3.2-1B
                 "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "tie_word_embeddings": True,
                 "rope_scaling": _LLAMA3_ROPE},
    "llama-3b": {**_LLAMA3, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,  # Llama-3.2-3B
                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "tie_word_embeddings": True,
                 "rope_scaling": _LLAMA3_ROPE},
    "llama-8b": {**_LLAMA3, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,  # Llama-3.1-8B
                 "num_key_value_heads": 8, "intermediate_size": 14336, "tie_word_embeddings": False,
                 "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
    "qwen2.5-1.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",  # Qwen2.5-1.5B-Instruct
                     "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "intermediate_size": 8960, "hidden_act": "silu", "initializer_range": 0.02,
                     "max_position_embeddings": 32768, "max_window_layers": 21, "rms_norm_eps": 1e-6,
                     "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
                     "tie_word_embeddings": True},
    "gemma3-270m": {**_GEMMA3, "hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4,
                    "num_key_value_heads": 1, "intermediate_size": 2048},
    "gemma3-1b": {**_GEMMA3, "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
                  "num_key_value_heads": 1, "intermediate_size": 6912},
    # Mixture-of-experts. moe-1b-16x2 is no released model but llama-1b with 16 experts of half its MLP, top-2: the
    # same active parameters (1.07 B), for the MoE bench against llama-1b (docs/moe.md).
    "moe-1b-16x2": {**_MIXTRAL, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 4096, "num_local_experts": 16,
                    "num_experts_per_tok": 2, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                    "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": True},
    "mixtral-8x7b": {**_MIXTRAL, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                     "rope_theta": 1000000.0, "tie_word_embeddings": False},
    "qwen1.5-moe-a2.7b": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                          "intermediate_size": 5632, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
                          "norm_topk_prob": False, "decoder_sparse_step": 1, "hidden_act": "silu",
                          "initializer_range": 0.02, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                          "rope_theta": 1000000.0, "use_sliding_window": False, "tie_word_embeddings": False},
}

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# Gemma's RMSNorm scales by (1 + weight): its neutral weight is 0, Llama's and Qwen's is 1.
NORM_WEIGHT = {"gemma3_text": 0.0}
_CONFIG_FILES = ("config.json", "generation_config.json", WEIGHTS_INDEX)
TOKENIZER_FILES = tuple(name for name in MODEL_FILE_LIMITS if name not in _CONFIG_FILES)
INDEX_FILE = WEIGHTS_INDEX
GIB = 1 << 30


class RandomModelError(Exception):
    """A request the script refuses (an output directory inside a git checkout, one already there, a bad size)."""


@dataclass(frozen=True)
class Overrides:
    """Smaller models of the same family, for tests: None keeps the real value."""
    layers: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    head_dim: int | None = None

    def suffix(self) -> str:
        parts = zip("Lhid", (self.layers, self.hidden, self.intermediate, self.head_dim))
        return "".join(f"-{tag}{value}" for tag, value in parts if value is not None)


@dataclass(frozen=True)
class Summary:
    shape: str
    out: Path
    parameters: int
    bytes: int
    files: int
    seconds: float

    def line(self) -> str:
        return (f"{self.shape}: {self.parameters / 1e9:.2f} B parameters ({self.parameters:,}), "
                f"{self.bytes / GIB:.2f} GiB in {self.files} safetensors file(s), {self.seconds:.1f} s -> {self.out}")


def model_config(shape: str, tokenizer, overrides: Overrides = Overrides()) -> dict:
    """config.json: the shape's real fields (their transformers 4 spelling, which 5 also reads), the tokenizer's
    vocabulary and ids, the overrides, and every other field at its transformers default."""
    from transformers import CONFIG_MAPPING

    fields = {**copy.deepcopy(shape_fields(shape)), "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if overrides.hidden is not None:  # keep the real heads and head size: what the attention kernels see
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    for key, value in (("num_hidden_layers", overrides.layers), ("hidden_size", overrides.hidden),
                       ("intermediate_size", overrides.intermediate), ("head_dim", overrides.head_dim)):
        if value is not None:
            fields[key] = value
    try:
        filled = CONFIG_MAPPING[fields["model_type"]].from_dict(copy.deepcopy(fields)).to_diff_dict()  # edits dicts
    except Exception as exc:  # an override the architecture does not allow (transformers' errors vary by version)
        raise RandomModelError(f"{shape} with {overrides}: {exc}") from None
    filled.pop("rope_parameters", None)  # transformers 5 only; 5 rebuilds it from the fields above
    return {**filled, **fields}


def shape_fields(shape: str) -> dict:
    """A named shape's fields, or for any other name a transformers model_type with a causal LM (phi3, gpt_oss,
    deepseek_v3, ...): that architecture at transformers' own default config, which is mostly its reference model's
    shape (e.g. Phi-3-mini for phi3), to be cut down with the overrides."""
    if shape in SHAPES:
        return SHAPES[shape]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if shape not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise RandomModelError(f"unknown shape {shape!r}: neither one of {', '.join(SHAPES)} nor a transformers "
                               f"model_type with a causal LM")
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[shape]().to_dict()
    for key in ("transformers_version", "dtype", "torch_dtype", "architectures"):
        defaults.pop(key, None)
    return {**defaults, "model_type": shape, "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[shape]]}


def hf_config(config: dict):
    """The transformers config of a config.json dict, as from_pretrained builds it."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, named as transformers saves it, from the model built on the meta device (no
    memory); a tied LM head is the embedding, so it is not listed."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config))
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        shapes.update(saved_tensors(name, tuple(param.shape), config["model_type"]))
    return shapes


# How transformers 5's save_pretrained writes the experts it holds as one 3D tensor per projection
# (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]): one tensor per expert and projection,
# under the block's and projections' names of the model's original checkpoints.
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
_EXPERT_NAMES_DEFAULT = ("mlp", "gate_proj", "up_proj", "down_proj")


def saved_tensors(name: str, shape: tuple[int, ...], model_type: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors that transformers saves for its parameter `name`."""
    block, gate, up, down = _EXPERT_NAMES.get(model_type, _EXPERT_NAMES_DEFAULT)
    layer, found, projection = name.partition("mlp.experts.")
    if found and projection in ("gate_up_proj", "down_proj"):
        experts, rows, columns = shape
        parts = ((gate, rows // 2), (up, rows // 2)) if projection == "gate_up_proj" else ((down, rows),)
        return {f"{layer}{block}.experts.{e}.{part}.weight": (part_rows, columns)
                for e in range(experts) for part, part_rows in parts}
    return {name.replace(".mlp.", f".{block}."): shape}


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, std: float,
                  norm_weight: float) -> torch.Tensor:
    """Norm weights at their neutral value, everything else (matrices, biases) normal(0, std)."""
    if name.endswith("norm.weight"):
        return torch.full(shape, norm_weight, dtype=dtype)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=generator)


def plan_shards(shapes: dict[str, tuple[int, ...]], element_size: int, max_bytes: int) -> list[list[str]]:
    """Tensor names in checkpoint order, cut greedily into shards of at most max_bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = element_size * math.prod(shape)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_files(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_weights(out: Path, shapes: dict[str, tuple[int, ...]], shards: list[list[str]], config: dict,
                  seed: int) -> None:
    """The safetensors shards, one in memory at a time, and their index when there are several."""
    dtype = DTYPES[config["torch_dtype"]]
    std = config.get("initializer_range", 0.02)
    norm_weight = NORM_WEIGHT.get(config["model_type"], 1.0)
    files = shard_files(len(shards))
    for file, names in zip(files, shards):
        tensors = {name: random_tensor(name, shapes[name], dtype, seed, std, norm_weight) for name in names}
        save_file(tensors, out / file, metadata={"format": "pt"})
        del tensors  # before the next shard's are drawn
    if len(files) > 1:
        parameters = sum(math.prod(shape) for shape in shapes.values())
        index = {"metadata": {"total_size": parameters * dtype.itemsize, "total_parameters": parameters},
                 "weight_map": {name: file for file, names in zip(files, shards) for name in names}}
        _write_json(out / INDEX_FILE, index)


def copy_tokenizer(source: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    if (source / "additional_chat_templates").is_dir():
        shutil.copytree(source / "additional_chat_templates", out / "additional_chat_templates")


def git_checkout_of(path: Path) -> Path | None:
    for folder in (path, *path.parents):
        if (folder / ".git").exists():
            return folder
    return None


def default_out(shape: str, dtype: str, seed: int, overrides: Overrides) -> Path:
    seed_part = f"-seed{seed}" if seed else ""
    return cache_root() / "random-models" / f"{shape}-{dtype}{overrides.suffix()}{seed_part}"


def check_out(out: Path) -> Path:
    """The output directory, resolved; refused inside a git checkout."""
    out = Path(out).expanduser().resolve()
    checkout = git_checkout_of(out)
    if checkout is not None:
        raise RandomModelError(f"{out} is inside the git checkout {checkout}: weights must never land in git; "
                               f"give an --out outside it")
    if out.exists() and not out.is_dir():
        raise RandomModelError(f"{out} exists and is not a directory")
    return out


def clear_out(out: Path, force: bool) -> None:
    """An empty or new directory is taken; a non-empty one only with `force`, which deletes its model files (and
    nothing else: a stale shard would be loaded with the new ones)."""
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise RandomModelError(f"{out} is not empty; --force replaces the model files there")
        for entry in out.iterdir():
            if entry.name == "additional_chat_templates":
                shutil.rmtree(entry)
            elif entry.suffix == ".safetensors" or entry.name in (*_CONFIG_FILES, *TOKENIZER_FILES, INDEX_FILE):
                entry.unlink()
    out.mkdir(parents=True, exist_ok=True)


def make_random_model(shape: str, out: Path | None = None, *, dtype: str = "bfloat16", seed: int = 0,
                      tokenizer_dir: Path | None = None, overrides: Overrides = Overrides(),
                      max_shard_bytes: int = 2 * GIB, force: bool = False, dry_run: bool = False) -> Summary:
    """Write the model directory (with dry_run, only plan it: nothing is written) and return its summary."""
    start = time.monotonic()
    shape_fields(shape)  # a name it knows
    if dtype not in DTYPES:
        raise RandomModelError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if max_shard_bytes <= 0:
        raise RandomModelError(f"the shard size must be positive, not {max_shard_bytes} bytes")
    out = check_out(default_out(shape, dtype, seed, overrides) if out is None else out)
    source = Path(tokenizer_dir) if tokenizer_dir is not None else resolve_model("default")
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise RandomModelError(f"no tokenizer files in {source}")
    config = {**model_config(shape, tokenizer, overrides), "torch_dtype": dtype, "dtype": dtype}
    shapes = tensor_shapes(config)
    shards = plan_shards(shapes, DTYPES[dtype].itemsize, max_shard_bytes)
    if not dry_run:
        clear_out(out, force)
        copy_tokenizer(source, out)
        _write_json(out / "config.json", config)
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        _write_json(out / "generation_config.json", {key: config[key] for key in ids if config[key] is not None})
        write_weights(out, shapes, shards, config, seed)
    parameters = sum(math.prod(shape) for shape in shapes.values())
    return Summary(shape, out, parameters, parameters * DTYPES[dtype].itemsize, len(shards),
                   time.monotonic() - start)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, help=f"one of {', '.join(SHAPES)}, or any transformers "
                                                        f"model_type with a causal LM (its default config)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="default: $BATCHGEN_CACHE_DIR (~/.cache/batchgen)/random-models/"
                                                 "<shape>-<dtype>[overrides][-seed<n>]")
    parser.add_argument("--tokenizer", type=Path, help="a directory with tokenizer files (default: batchgen's "
                                                       "default model's, SmolLM2, 49152 tokens)")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers")
    parser.add_argument("--hidden", type=int, help="override hidden_size (heads and head_dim stay)")
    parser.add_argument("--intermediate", type=int, help="override intermediate_size")
    parser.add_argument("--head-dim", type=int, help="override head_dim")
    parser.add_argument("--max-shard-gib", type=float, default=2.0, help="most bytes per safetensors file (GiB)")
    parser.add_argument("--force", action="store_true", help="replace the model files of an existing --out")
    parser.add_argument("--dry-run", action="store_true", help="print the summary, write nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = Overrides(args.layers, args.hidden, args.intermediate, args.head_dim)
    try:
        summary = make_random_model(args.shape, args.out, dtype=args.dtype, seed=args.seed,
                                    tokenizer_dir=args.tokenizer, overrides=overrides,
                                    max_shard_bytes=int(args.max_shard_gib * GIB), force=args.force,
                                    dry_run=args.dry_run)
    except (RandomModelError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(("(dry run) " if args.dry_run else "") + summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
