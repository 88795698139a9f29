"""The files of an HF-style model directory that batchgen or transformers reads, and which of its *.safetensors
files hold the checkpoint: with model.safetensors.index.json, exactly those the index names (a stray file beside
them is not read, as in transformers), else every *.safetensors in the directory."""
from __future__ import annotations

import os
from pathlib import Path

from batchgen.user_files import MODEL_CONFIG_LIMIT, TOKENIZER_FILE_LIMIT

from .gguf_cache import check_file, read_json
from .registry import ModelError, ModelNotFoundError

WEIGHTS_INDEX = "model.safetensors.index.json"

# The files of a model directory that batchgen or transformers reads, and the most each may hold (*.safetensors:
# regular files of any size; additional_chat_templates/*.jinja: as chat_template.jinja).
MODEL_FILE_LIMITS = {
    "config.json": MODEL_CONFIG_LIMIT, "generation_config.json": MODEL_CONFIG_LIMIT, WEIGHTS_INDEX: MODEL_CONFIG_LIMIT,
    "tokenizer_config.json": MODEL_CONFIG_LIMIT, "special_tokens_map.json": MODEL_CONFIG_LIMIT,
    "added_tokens.json": MODEL_CONFIG_LIMIT, "chat_template.jinja": MODEL_CONFIG_LIMIT,
    "chat_template.json": MODEL_CONFIG_LIMIT, "tokenizer.json": TOKENIZER_FILE_LIMIT,
    "tokenizer.model": TOKENIZER_FILE_LIMIT, "vocab.json": TOKENIZER_FILE_LIMIT, "merges.txt": TOKENIZER_FILE_LIMIT,
}
CHAT_TEMPLATES = "additional_chat_templates/*.jinja"


def indexed_shards(model_dir: Path) -> list[str] | None:
    """The shard file names model.safetensors.index.json maps the tensors to, or None without an index."""
    index = Path(model_dir) / WEIGHTS_INDEX
    if not os.path.lexists(index):
        return None
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelError(f"{index} has no weight_map (tensor name -> .safetensors file)")
    names = sorted(set(weight_map.values()))
    outside = [name for name in names if name in ("", ".", "..") or Path(name).name != name]
    if outside:
        raise ModelError(f"{index} names shards outside its directory: {', '.join(outside[:3])}")
    return names


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's *.safetensors files (none: an empty list); a ModelNotFoundError naming the shards the index
    names but the directory lacks (an interrupted copy or download)."""
    model_dir = Path(model_dir)
    names = indexed_shards(model_dir)
    if names is None:
        return sorted(model_dir.glob("*.safetensors"))
    missing = [name for name in names if not os.path.lexists(model_dir / name)]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelNotFoundError(f"{model_dir / WEIGHTS_INDEX} names {len(names)} shards, but {shown} "
                                f"{'is' if len(missing) == 1 else 'are'} not in {model_dir}")
    return [model_dir / name for name in names]


def check_model_files(path: Path) -> None:
    """Each file of the directory that batchgen or transformers reads, where present, is a regular file under its
    cap (MODEL_FILE_LIMITS), checked before anything reads it: a FIFO or a device would block or never end."""
    files = [(path / name, limit) for name, limit in MODEL_FILE_LIMITS.items() if os.path.lexists(path / name)]
    files += [(file, MODEL_CONFIG_LIMIT) for file in sorted(path.glob(CHAT_TEMPLATES))]
    for file, limit in files:  # the index among them, before weight_files reads it
        check_file(file, limit)
    for file in weight_files(path):
        check_file(file)
