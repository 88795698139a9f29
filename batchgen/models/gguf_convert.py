"""A GGUF file converted into a model directory for batchgen's cache (gguf_cache.py), one tensor at a time.

For an architecture batchgen runs (natively or on the generic path), the GGUF is read with gguf's GGUFReader
(memory-mapped) and each tensor goes its own way, a few rows at a time: dequantized (gguf.quants.dequantize), put in
transformers' layout by transformers' own GGUF tensor processor (Llama's q/k reverse permute, Gemma's norms less
one) under transformers' own name for it (get_gguf_hf_weights_map), then, for the weight of a Linear layer,
requantized at once to batchgen's int8 (quantization.quantize_weight), else kept in fp32; and written straight to
model.safetensors, whose header is known before the first tensor is read. The file's pages are dropped from this
process once read. So the conversion holds a few rows in fp32 at a time, never the model: an 8B Q4_K_M file converts
at ~1 GiB peak RSS, most of it the vocabulary's metadata (docs/models.md). The result is gguf_int8.py's checkpoint, loaded as int8. Config and tokenizer come
from transformers' GGUF support.

A GGUF whose tensors are not one to one with transformers' parameters (experts stored stacked in one tensor, a
processor that merges tensors) is converted as before: the whole model loaded through transformers in fp32 and saved
dequantized (fp32)."""
from __future__ import annotations

import json
import logging
import mmap
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .gguf_int8 import INT8_CONFIG_KEY, SCALE_SUFFIX
from .quantization import quantize_weight
from .registry import ModelError, model_path

logger = logging.getLogger("batchgen")

DEQUANTIZE_CHUNK_BYTES = 4 << 20  # a tensor's rows dequantized at once, counted in fp32
_F32_BYTES = 4

__all__ = ["convert_gguf"]


@dataclass(frozen=True)
class _Planned:
    """One GGUF tensor as it will be written."""

    source: object  # gguf's ReaderTensor
    name: str  # transformers' name
    shape: tuple[int, ...]  # transformers' (rows, columns), or (n,)
    int8: bool  # a Linear's weight: int8 + scales
    rows: np.ndarray | None  # the source row of each row written (a processor's row permutation); None: in order
    whole: bool  # the processor changes values, not only the row order: processed as one tensor


def convert_gguf(gguf: Path, out_dir: Path, int8: bool = True) -> None:
    """Write the model directory for `gguf` into `out_dir`: config.json, generation_config.json, the tokenizer and
    model.safetensors (each Linear's weight int8, the rest fp32; everything fp32 without `int8`, or where the
    tensors are not one to one with transformers': a plain checkpoint transformers loads, for comparisons).
    ModelError for a file transformers cannot read or an architecture batchgen does not run."""
    with _read_by_transformers(gguf):
        from transformers import AutoConfig, AutoTokenizer

        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model_path(config)  # an architecture batchgen does not run is refused before anything is converted
    with _read_by_transformers(gguf):
        from gguf import GGUFReader

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        reader = GGUFReader(gguf)
        architecture = str(reader.fields["general.architecture"].contents())
        # The metadata's parsed parts (the vocabulary: ~140 MiB for 49k tokens) are not needed past here.
        reader.fields.clear()
    plan, hf_class, processor = _plan(reader, architecture, config, int8)
    if plan is None:
        del reader
        _convert_through_transformers(gguf, out_dir)
        return
    _write_tensors(reader, plan, processor, out_dir / "model.safetensors")
    types = Counter(entry.source.tensor_type.name for entry in plan if entry.int8)
    _write_config(config, hf_class, out_dir, {"weights": "int8, one fp32 scale per output row (rounded to bf16)",
                                              "others": "float32", "source": "gguf",
                                              "source_types": dict(sorted(types.items()))} if int8 else None)
    tokenizer.save_pretrained(out_dir)


def _plan(reader, architecture: str, config, int8: bool) -> tuple[list[_Planned] | None, str, object]:
    """Each GGUF tensor's name, shape and treatment, decided before any is read (the safetensors header lists them
    all); None where a tensor is not one GGUF tensor to one of transformers' (stacked experts, a processor that
    consumes tensors), and the transformers class and tensor processor."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    config_dict = config.to_dict()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config_dict)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    hf_names = get_gguf_hf_weights_map(hf_model, processor)
    linear = {f"{name}.weight" for name, module in hf_model.named_modules() if isinstance(module, torch.nn.Linear)}
    plan = []
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if len(shape) > 2:
            return None, type(hf_model).__name__, processor
        probe = np.arange(shape[0], dtype=np.float64)[:, None] if len(shape) == 2 else np.zeros(shape)
        parsed = {"tensors": {}, "config": config_dict}
        result = processor.process(weights=probe, name=tensor.name, tensor_key_mapping=hf_names,
                                   parsed_parameters=parsed)
        if result.name is None or parsed["tensors"]:
            return None, type(hf_model).__name__, processor
        if result.name not in hf_names:  # as transformers: a tensor it has no parameter for (rope_freqs)
            logger.debug("GGUF tensor %s has no transformers parameter; not converted", tensor.name)
            continue
        rows, whole = None, len(shape) == 1
        if not whole and not np.array_equal(result.weights, probe):
            order = np.asarray(result.weights)
            permutation = order.shape == probe.shape and np.array_equal(np.sort(order[:, 0]), probe[:, 0])
            rows, whole = (order[:, 0].astype(np.int64), False) if permutation else (None, True)
        name = hf_names[result.name]
        plan.append(_Planned(tensor, name, shape, int8 and name in linear and len(shape) == 2, rows, whole))
    return plan, type(hf_model).__name__, processor


def _write_tensors(reader, plan: list[_Planned], processor, path: Path) -> None:
    """model.safetensors: its header first (every entry's offsets, from the plan), then each tensor's data as it is
    converted, rows in order; an int8 weight's scales after it."""
    entries, offset = {}, 0
    for entry in plan:
        parts = [(entry.name, "I8", entry.shape, entry.shape[0] * entry.shape[1]),
                 (entry.name + SCALE_SUFFIX, "F32", entry.shape[:1], entry.shape[0] * _F32_BYTES)] if entry.int8 \
            else [(entry.name, "F32", entry.shape, int(np.prod(entry.shape)) * _F32_BYTES)]
        for name, dtype, shape, nbytes in parts:
            entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as out:
        out.write(len(header).to_bytes(8, "little") + header)
        for entry in plan:
            scales = torch.empty(entry.shape[0], dtype=torch.float32) if entry.int8 else None
            row = 0
            for chunk in _rows_in_fp32(entry, processor):
                if entry.int8:
                    q, scale = quantize_weight(torch.from_numpy(chunk), torch.bfloat16)
                    out.write(q.numpy())
                    scales[row:row + len(chunk)] = scale.float()
                else:
                    out.write(chunk)
                row += len(chunk)
            if scales is not None:
                out.write(scales.numpy())
            _drop_pages(reader, entry.source)
        if out.tell() != 8 + len(header) + offset:
            raise ModelError(f"converting to {path} wrote {out.tell():,} bytes, not the {8 + len(header) + offset:,} "
                             f"its header says")


def _rows_in_fp32(entry: _Planned, processor):
    """The tensor's rows in transformers' layout and order, as writable fp32 arrays of a few MiB each."""
    from gguf import dequantize

    tensor = entry.source
    try:
        if entry.whole:
            weights = dequantize(tensor.data, tensor.tensor_type)
            weights = np.array(processor.process(weights=weights, name=tensor.name).weights, dtype=np.float32)
            if weights.shape != entry.shape:
                raise ModelError(f"GGUF tensor {tensor.name}: transformers' processor made it {list(weights.shape)}, "
                                 f"not {list(entry.shape)}")
            yield weights
            return
        step = max(1, DEQUANTIZE_CHUNK_BYTES // (_F32_BYTES * entry.shape[1]))
        for first in range(0, entry.shape[0], step):
            rows = slice(first, first + step) if entry.rows is None else entry.rows[first:first + step]
            weights = dequantize(tensor.data[rows], tensor.tensor_type)
            # an F32 tensor's rows are a read-only view of the file: copied, as torch needs them writable
            yield weights if weights.flags.writeable and weights.dtype == np.float32 else \
                np.array(weights, dtype=np.float32)
    except NotImplementedError:
        raise ModelError(f"GGUF tensor {tensor.name} is of type {tensor.tensor_type.name}, which gguf "
                         f"cannot dequantize") from None


def _drop_pages(reader, tensor) -> None:
    """Unmap the pages of the file that `tensor` was read from: they count in this process's RSS until then (the
    page cache keeps them for whoever reads them next)."""
    mapping = getattr(reader.data, "_mmap", None)
    if mapping is None:
        return
    start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
    try:
        mapping.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)
    except (OSError, ValueError):  # a platform without madvise: the pages stay until the reader is dropped
        pass


def _write_config(config, hf_class: str, out_dir: Path, int8: dict | None) -> None:
    """config.json as transformers saves it (less any quantization_config: the weights are plain tensors), with
    the architecture transformers loads it as and, for an int8 checkpoint, INT8_CONFIG_KEY; and
    generation_config.json, as transformers derives it from the config."""
    from transformers import GenerationConfig

    config.save_pretrained(out_dir)
    path = out_dir / "config.json"
    saved = json.loads(path.read_text())
    saved.pop("quantization_config", None)
    saved["architectures"] = [hf_class]
    saved["dtype"] = "float32"
    if int8 is not None:
        saved[INT8_CONFIG_KEY] = int8
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)


@contextmanager
def _read_by_transformers(gguf: Path):
    """transformers' or gguf's failure to read the file as a ModelError naming it."""
    try:
        with _no_progress_bars():
            yield
    except (MemoryError, ModelError):
        raise
    except Exception as exc:  # transformers and gguf raise many types for a file they cannot read
        text = str(exc).strip().splitlines()
        raise ModelError(f"{gguf} is not a GGUF file transformers can convert ({type(exc).__name__}"
                         f"{': ' + text[0] if text else ''})") from exc


@contextmanager
def _no_progress_bars():
    """Without transformers' progress bars while converting: they would reach stderr under `--quiet` and fill logs
    (the INFO line before the conversion says what is happening). Its GGUF reader draws its per-tensor bar with tqdm
    directly, past transformers' own switch, so that one is swapped for a silent tqdm meanwhile."""
    from functools import partial

    import transformers.modeling_gguf_pytorch_utils as gguf_reader
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    bars_were_on, reader_bar = hf_logging.is_progress_bar_enabled(), getattr(gguf_reader, "tqdm", None)
    hf_logging.disable_progress_bar()
    if reader_bar is not None:
        gguf_reader.tqdm = partial(tqdm, disable=True)
    try:
        yield
    finally:
        if reader_bar is not None:
            gguf_reader.tqdm = reader_bar
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _convert_through_transformers(gguf: Path, out_dir: Path) -> None:
    """The whole model dequantized by transformers in fp32, and written with its config, generation config and
    tokenizer. The weights are written with safetensors directly: transformers >= 5 keeps a GGUF quantizer
    attached to the model and refuses `save_pretrained`, even once every weight is dequantized."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _read_by_transformers(gguf):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = model.state_dict()
    embed, lm_head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
    if lm_head is not None and embed is not None and lm_head.data_ptr() == embed.data_ptr():
        del state["lm_head.weight"]  # tied: safetensors refuses shared tensors; the loader re-ties
    packed = [name for name, tensor in state.items() if not tensor.is_floating_point()]
    if packed:
        raise ModelError(f"converting {gguf} left packed (not dequantized) tensors: {', '.join(packed[:5])}")
    save_file({name: t.detach().contiguous() for name, t in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    _write_config(model.config, type(model).__name__, out_dir, None)
    tokenizer.save_pretrained(out_dir)
