"""The model inspector: one description of a model, from its config and its checkpoint's headers, without reading
a weight. Everything that needs a model's shape reads it here: the engine's start-up (the KV cache's size, the
prefaulted heap, the Triton shape check: engine/engine_plan.py), `batchgen plan` (memory, weight bytes), the bench,
the roofline and the GPU check.

The architecture's own rules decide the shape (e.g. Gemma 3's sliding-window layers, a context capped at a sliding
window): the model is built on the meta device (no memory) by the registry and read off, so the inspector and the
loaded model cannot disagree. A GGUF is described once converted (loader.resolve_model: its cache entry is a
safetensors directory). `task` and `architecture` are what a later model path (a generic transformers model,
pooling or embedding tasks, adapters) is told apart by; the engine's decisions about a model are not here but in
the engine plan."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .checkpoint_files import weight_files
from .registry import GENERIC, NATIVE, architecture_of, build_model, model_path, model_variant
from .safetensors_header import read_safetensors_header

TASK_GENERATE = "generate"  # a decoder's next-token generation: the one task the engine runs today
# safetensors dtype names -> bytes per number
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class CheckpointTensor:
    """One checkpoint tensor that the loader reads (from the header: no data)."""

    name: str  # as the checkpoint names it (transformers' names)
    parameter: str  # our parameter it goes into (q/k/v into qkv_proj, gate/up into gate_up_proj)
    dtype: str  # the checkpoint's: "BF16", "F32", ...
    shape: tuple[int, ...]
    fused: bool  # concatenated with others into its parameter
    linear: bool  # a matmul weight (an nn.Linear's): what packing and int8 replace

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelDescription:
    """A model as the engine will build it. Built by describe_model (a model directory) or describe_config (a
    config alone: no checkpoint, e.g. the GPU check's random-weight shapes)."""

    architecture: str  # config.architectures[0] as the registry reads it: "LlamaForCausalLM", ...
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int  # the context the model can attend over (the architecture's rule)
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: the whole context)
    tie_word_embeddings: bool = False  # the LM head is the embedding table (said by the config, or by a checkpoint
    #                                    without lm_head.weight)
    num_experts: int = 0  # MoE experts per layer (0: dense)
    task: str = TASK_GENERATE
    path: str = NATIVE  # registry.NATIVE (batchgen's implementation) or GENERIC (transformers' code on the engine)
    value_dim: int = 0  # the values' head width where it is not head_dim (MLA: values cached padded to head_dim)
    parameters: int = 0  # the model's parameters, a tied head counted once
    files: int = 0  # checkpoint shards (0: described from a config alone)
    checkpoint_numel: int = 0  # every number the shards hold, tensors the loader skips included
    tensors: tuple[CheckpointTensor, ...] = ()  # the checkpoint tensors the loader reads

    @property
    def checkpoint_dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({tensor.dtype for tensor in self.tensors}))

    @property
    def checkpoint_bytes(self) -> int:
        """The bytes of the tensors the loader reads, in the checkpoint's dtypes."""
        return sum(tensor.numel * _DTYPE_BYTES.get(tensor.dtype, 4) for tensor in self.tensors)

    def parameter_bytes(self, dtype: torch.dtype) -> int:
        """The parameters held in `dtype`."""
        return self.parameters * dtype.itemsize

    def describe(self) -> dict:
        """The description for a record: every field but the tensor list."""
        return {key: value for key, value in asdict(self).items() if key != "tensors"}


@dataclass(frozen=True)
class CheckpointHeaders:
    """What a model directory's safetensors headers say, read without a weight (nor transformers)."""

    entries: dict[str, dict]  # checkpoint tensor name -> its header entry (dtype, shape)
    files: int  # shards
    numel: int  # every number the shards hold, tensors the loader skips included


def read_checkpoint_headers(model_dir: Path) -> CheckpointHeaders:
    """The headers of the safetensors files in `model_dir`. Raises OSError, ModelError (no weights) or
    SafetensorsHeaderError (a ValueError) for a header that is not one."""
    files = weight_files(Path(model_dir))
    entries = {}
    numel = 0
    for file in files:
        for name, entry in read_safetensors_header(file).entries.items():
            entries[name] = entry
            numel += math.prod(entry["shape"])
    return CheckpointHeaders(entries, len(files), numel)


def describe_model(model_dir: Path, config=None, checkpoint: CheckpointHeaders | None = None,
                   model_impl: str = "auto") -> ModelDescription:
    """The model in `model_dir`: its config (AutoConfig, unless given) and its safetensors headers (read, unless
    given). Raises what reading them raises: OSError or ValueError for an unreadable config, UnsupportedModelError
    (a ValueError) for an architecture or setting our models do not implement, SafetensorsHeaderError (a ValueError)
    for a header that is not one."""
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
    if checkpoint is None:
        checkpoint = read_checkpoint_headers(model_dir)
    return describe_config(config, checkpoint.entries, checkpoint.files, checkpoint.numel, model_impl)


def describe_config(config, headers: dict[str, dict] | None = None, files: int = 0,
                    checkpoint_numel: int = 0, model_impl: str = "auto") -> ModelDescription:
    """The model a transformers `config` builds; with `headers` (checkpoint tensor name -> header entry), the
    checkpoint's say in it too: no lm_head.weight means a tied head (the loader's rule), and the tensors read."""
    if model_path(config, model_impl) == GENERIC:
        return describe_generic(config, headers, files, checkpoint_numel)
    variant = model_variant(config)
    if headers is not None:
        variant = checkpoint_variant(variant, headers)
    with torch.device("meta"):
        model = build_model(config, variant)
    linear = {f"{name}.weight" for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    tensors = tuple(CheckpointTensor(name, param, headers[name]["dtype"], tuple(headers[name]["shape"]),
                                     len(sources) > 1, param in linear)
                    for param, sources in checkpoint_sources(model).items() for name in sources
                    if headers is not None and name in headers)
    experts = getattr(model, "num_experts", 0)  # the architecture's own reading of its config (moe_models.py)
    return ModelDescription(
        architecture=architecture_of(config), num_layers=model.num_layers, num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", 0), vocab_size=config.vocab_size,
        max_model_len=model.max_model_len,
        layer_windows=tuple(model.sliding_windows()), tie_word_embeddings=variant.tie_word_embeddings,
        num_experts=int(experts), parameters=sum(p.numel() for p in model.parameters()), files=files,
        checkpoint_numel=checkpoint_numel, tensors=tensors)


def describe_generic(config, headers: dict[str, dict] | None, files: int, checkpoint_numel: int) -> ModelDescription:
    """A model on the generic path: transformers' own class built on the meta device and read off
    (generic_support.describe)."""
    from .generic_support import build_on_meta, describe

    model = build_on_meta(config)
    shape = describe(model, config)
    linear = {f"{name}.weight" for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    names = {name for name, _ in model.named_parameters()}
    tensors = tuple(CheckpointTensor(name, name, entry["dtype"], tuple(entry["shape"]), False, name in linear)
                    for name, entry in (headers or {}).items() if name in names)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelDescription(
        architecture=type(model).__name__, num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 0) or 0, vocab_size=shape.vocab_size,
        max_model_len=shape.max_model_len, layer_windows=shape.layer_windows,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)), num_experts=shape.experts,
        path=GENERIC, value_dim=shape.value_dim, parameters=shape.parameters, files=files,
        checkpoint_numel=checkpoint_numel, tensors=tensors)


def checkpoint_variant(variant, names) -> object:
    """The variant a checkpoint holding tensors `names` loads as: one without lm_head.weight is tied."""
    return variant if "lm_head.weight" in names else replace(variant, tie_word_embeddings=True)


def checkpoint_sources(model) -> dict[str, list[str]]:
    """Each of our parameters → the checkpoint tensors (transformers' names) it is made of, in concatenation order.
    An expert's are named as transformers 5 saves them (`mlp.experts.N.gate_proj.weight`, one tensor per expert and
    projection); a model whose checkpoints name some otherwise says so with its `checkpoint_name` (Mixtral's
    `block_sparse_moe.experts.N.w1`: moe_models.py)."""
    rename = getattr(model, "checkpoint_name", lambda name: name)
    sources = {}
    for name, _ in model.named_parameters():  # a tied lm_head is the embedding, so it is not listed again
        if ".qkv_proj." in name:
            sources[name] = [name.replace(".qkv_proj.", f".{part}.") for part in ("q_proj", "k_proj", "v_proj")]
        elif ".gate_up_proj." in name:
            sources[name] = [name.replace(".gate_up_proj.", f".{part}.") for part in ("gate_proj", "up_proj")]
        else:
            sources[name] = [name]
    return {param: [rename(name) for name in names] for param, names in sources.items()}
