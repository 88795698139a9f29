"""Loading a model for the generic path (generic.py).

Where the checkpoint names every parameter of transformers' model as the model names it (dense models, and any
whose transformers code needs no weight conversion), the weights are streamed as the native loader streams them:
the model built with its parameters on the meta device (its buffers, the RoPE tables, real), each tensor read with
plain file reads into memory the process owns (weight_reader.py), and each Linear packed for oneDNN as soon as it is
read, so that no weight is resident twice and nothing maps the checkpoint. Otherwise (a checkpoint transformers
converts on load: per-expert tensors fused into one, renamed keys) transformers' own from_pretrained loads it, and
the tensors it leaves as views of the mapped file are copied out so that the mapping closes.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn

from .checkpoint_files import weight_files
from .generic import TransformersCausalLM
from .generic_attention import ATTENTION_NAME, register_attention
from .generic_support import causal_lm_class, describe
from .gguf_int8 import read_int8, stores_int8
from .packed_linear import PackedLinear
from .quantization import Int8Linear
from .upcast_linear import UpcastLinear, upcast_supported
from .weight_reader import ShardReader, Staging


def load_generic_model(model_dir: Path, config, dtype: torch.dtype, device: torch.device,
                       pack: bool = False, int8_activations: str | None = None) -> TransformersCausalLM:
    """The transformers model in `model_dir` behind the engine's model contract, in `dtype` on `device`.
    `int8_activations`: the checkpoint is a converted GGUF's int8 (gguf_int8.py), each Linear stored in int8 becoming
    an Int8Linear with these activations (quantization.ACTIVATIONS)."""
    register_attention()
    config._attn_implementation = ATTENTION_NAME
    model_class = causal_lm_class(config)
    with ExitStack() as stack:
        shard_of = {}
        for file in weight_files(Path(model_dir)):
            shard = ShardReader(file)
            stack.callback(shard.close)
            shard_of.update(dict.fromkeys(shard.keys(), shard))
        hf_model = _stream(model_class, config, shard_of, dtype, pack and device.type == "cpu", int8_activations)
    if hf_model is None:
        if int8_activations is not None:
            raise ValueError(f"{model_dir} holds int8 weights but does not name every parameter of "
                             f"{model_class.__name__}")
        hf_model = model_class.from_pretrained(model_dir, config=config, dtype=dtype,
                                               attn_implementation=ATTENTION_NAME)
        if pack and device.type == "cpu":
            for name, module in list(hf_model.named_modules()):
                _final_form(hf_model, name, module)
        if device.type == "cpu":
            _own_memory(hf_model)
    hf_model = hf_model.to(device).eval()
    return TransformersCausalLM(hf_model, describe(hf_model, hf_model.config))


def _stream(model_class, config, shard_of: dict[str, ShardReader], dtype: torch.dtype, pack: bool,
            int8_activations: str | None):
    """The model with every parameter read from the shards, or None where they do not name them all."""
    from accelerate import init_empty_weights

    with _default_dtype(dtype), init_empty_weights(include_buffers=False):
        model = model_class(config)
    model.tie_weights()  # transformers 5 ties a head to the embedding only when it loads weights
    wanted = {name for name, _ in model.named_parameters()}  # a tied head is the embedding: listed once
    if any(name not in shard_of for name in wanted):
        return None
    fp32 = _kept_in_fp32(model_class, dtype)
    casts, plains = Staging(), Staging()  # a Linear's plain weight, read only to be packed, goes to `plains`
    for module_name, module in list(model.named_modules()):
        int8 = None  # a Linear's weight stored in int8: (q, scale), the module replaced once its bias is read
        for leaf, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            name = f"{module_name}.{leaf}" if module_name else leaf
            if name not in wanted:  # a tied head's weight: tie_weights gives it the embedding's
                continue
            if int8_activations is not None and leaf == "weight" and type(module) is nn.Linear and \
                    stores_int8(shard_of, name):
                int8 = read_int8(shard_of, [name], list(param.shape))
                continue
            keep = torch.float32 if any(f".{kept}." in f".{name}." for kept in fp32) else dtype
            target = keep if param.is_floating_point() else param.dtype
            packed = pack and leaf == "weight" and type(module) is nn.Linear and \
                not upcast_supported(torch.device("cpu"), target)  # PackedLinear copies it; UpcastLinear keeps it
            tensor = plains.take(param.shape, target) if packed else torch.empty(param.shape, dtype=target)
            shard_of[name].read_into(name, tensor, casts)
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        if int8 is not None:
            _replace(model, module_name, Int8Linear.from_int8(*int8, module.bias, int8_activations, dtype))
        elif pack:
            _final_form(model, module_name, module)
    model.tie_weights()  # the head takes the embedding read above, where the config ties them
    if pack:
        head = model.get_output_embeddings()
        for name, module in model.named_modules():
            if module is head:
                _final_form(model, name, module)
    return model


def _kept_in_fp32(model_class, dtype: torch.dtype) -> set[str]:
    """The modules transformers keeps in fp32 at this dtype (its _keep_in_fp32_modules rules)."""
    kept = set(getattr(model_class, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        kept |= set(getattr(model_class, "_keep_in_fp32_modules", None) or ())
    return kept


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """As from_pretrained builds a model: tensors its code creates without a dtype take the model's."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else previous)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _final_form(model: nn.Module, name: str, module: nn.Module) -> None:
    """A fully read plain Linear replaced by its packed form (or bf16 computed in fp32), its plain weight freed."""
    if type(module) is not nn.Linear or module.weight.is_meta or module.weight.device.type != "cpu":
        return
    if upcast_supported(module.weight.device, module.weight.dtype):
        _replace(model, name, UpcastLinear(module.weight, module.bias))
    else:
        _replace(model, name, PackedLinear(module.weight, module.bias))


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def _own_memory(model: nn.Module) -> None:
    """Each remaining parameter and buffer copied out of the checkpoint's memory map, one at a time, so that the map
    (whose pages count in the process's RSS) closes once the last view of it goes: from_pretrained leaves tensors
    of the checkpoint's dtype as views of the mapped file."""
    copies: dict[int, torch.Tensor] = {}  # a tensor shared by two modules (a tied head) stays shared
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, tensor in list(tensors.items()):
                if tensor is None or tensor.device.type != "cpu" or tensor.is_mkldnn:
                    continue
                if id(tensor) not in copies:
                    copy = tensor.detach().clone()
                    copies[id(tensor)] = nn.Parameter(copy, requires_grad=False) \
                        if isinstance(tensor, nn.Parameter) else copy
                tensors[name] = copies[id(tensor)]
