"""The engine plan: what the engine decides about a model on this machine, resolved once into one frozen value:
the device, the dtype and why, the quantization's verdict, the attention kernels and why, the KV cache's bytes per
token, the pool's size and the context limit.

Its inputs are the engine settings (EngineArgs), the model's description (models/inspector.py: config and headers,
no weights) and a memory figure: measured by the engine at start-up (on CUDA, a profiling step with the weights
loaded), estimated by `batchgen plan` and the bench. The engine, `batchgen plan`, the bench, the roofline and the
job's summary (through the engine's stats) read the plan; nothing re-derives any of it. The one rule for each part
is here: resolve_device, resolve_dtype (cpu_features.py for `auto` on a CPU), check_quantization, kv_bytes_per_token,
the sizing sequence budget (kv_pool.kv_cache_budget) → context → pool (kv_pool.size_kv_pool), context_length.

The attention kernels are chosen by the engine (startup.choose_attention probes Triton or builds the C++ kernels,
which an estimate does not do): a plan made without them has attention None. A later model path (a generic
transformers model, adapters, pooling tasks) adds to the description what it is and to this plan what the engine
decided for it; `task` is the description's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from batchgen_kernels import BackendChoice

from ..models.inspector import ModelDescription
from ..models.quantization import WEIGHT_ONLY_DTYPES
from .cpu_features import DtypeChoice, auto_cpu_dtype, w8a8_slow_reason
from .engine_args import EngineArgs
from .errors import SettingError
from .kv_pool import KVPoolSize, kv_cache_budget, size_kv_pool
from .sliding_window import KVLayout, LocalLayers, kv_layout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineTarget:
    """What needs no model: the device, the dtype and why, and (when asked) the quantization's verdict."""

    device: torch.device
    dtype: DtypeChoice
    quantization: str | None = None  # accepted on this device and dtype (check_quantization)
    quantization_note: str | None = None  # why it is slow on this CPU (W8A8 without int8 dot products), or None


@dataclass(frozen=True)
class EnginePlan:
    model: ModelDescription
    target: EngineTarget
    attention: BackendChoice | None  # the kernels that run and why; None: not chosen (an estimate probes nothing)
    kv_layout: KVLayout  # the KV groups: one, or the global and the sliding-window layers' (sliding_window.py)
    kv_bytes_per_token: int  # K and V of the global group's layers, one token (the local group's: kv_pool.local)
    kv_pool: KVPoolSize  # its blocks and why (the budget and where it came from, or max_num_seqs' cap)
    max_model_len: int  # the shortest of: asked for, the model's context, what the KV cache holds
    context_limit: str  # which of them it is, e.g. "engine.max_model_len is 512 tokens"
    kv_dtype: torch.dtype | None = None  # the KV cache's: torch.int8 (engine.kv_cache_dtype: int8); None: the model's

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.target.dtype.dtype

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> DtypeChoice:
        return self.target.dtype

    @property
    def quantization(self) -> str | None:
        return self.target.quantization

    @property
    def task(self) -> str:
        return self.model.task


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SettingError("device", "device: cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> DtypeChoice:
    """The dtype asked for; for auto, bf16 on CUDA and on CPUs that compute it natively, fp32 on other CPUs."""
    if name in _DTYPES:
        return DtypeChoice(_DTYPES[name], f"{name}: set in dtype")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "bfloat16: auto on CUDA")
    return auto_cpu_dtype()


def check_quantization(quantization: str | None, dtype: DtypeChoice, device: torch.device) -> None:
    """int8-weight-only on the CPU keeps the activations in the model's dtype, and its kernel has no fast fp32 path:
    refused there with fp32 (on other devices the weight is dequantized for each matmul, in any dtype)."""
    if quantization == "int8-weight-only" and device.type == "cpu" and dtype.dtype not in WEIGHT_ONLY_DTYPES:
        name = str(dtype.dtype).removeprefix("torch.")
        raise SettingError("quantization", f"quantization int8-weight-only needs bfloat16 or float16 on the CPU, not "
                                           f"{name} ({dtype.reason}): set dtype: bfloat16 (its int8 kernel has no "
                                           f"fast float32 path), or use quantization: int8")


def resolve_target(device: str, dtype: str, quantization: str | None = None) -> EngineTarget:
    """Device and dtype settings ('auto' too) as the engine resolves them here; with a quantization, its verdict
    (SettingError where refused) and, where it is slow on this CPU, why."""
    resolved = resolve_device(device)
    choice = resolve_dtype(dtype, resolved)
    check_quantization(quantization, choice, resolved)
    note = w8a8_slow_reason() if quantization == "int8" and resolved.type == "cpu" else None
    return EngineTarget(resolved, choice, quantization, note)


def kv_layout_of(model: ModelDescription) -> KVLayout:
    """The engine's KV groups for `model` (one group of every layer where its layers' windows are not known)."""
    return kv_layout(model.layer_windows) if model.layer_windows else KVLayout(model.num_layers)


def kv_bytes_per_token(model: ModelDescription, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """K and V of every layer (or of `num_layers` of them) for one token: the one formula. An int8 cache holds a
    byte per element and an fp32 scale per kv head."""
    layers = model.num_layers if num_layers is None else num_layers
    if dtype == torch.int8:
        return 2 * layers * model.num_kv_heads * (model.head_dim + 4)
    return 2 * layers * model.num_kv_heads * model.head_dim * torch.finfo(dtype).bits // 8


def kv_cache_dtype(args: EngineArgs, target: EngineTarget) -> torch.dtype:
    """The KV cache's dtype: the model's, or int8 (engine.kv_cache_dtype), which every attention backend reads (the
    C++ CPU kernels, the Triton kernels and the torch reference)."""
    return torch.int8 if args.kv_cache_dtype == "int8" else target.dtype.dtype


def kv_group_bytes(layout: KVLayout, model: ModelDescription, dtype: torch.dtype) -> tuple[int, LocalLayers | None]:
    """K and V bytes per token of the global group's layers, and what sizing needs of the local group (None: one
    group)."""
    global_bytes = kv_bytes_per_token(model, dtype, len(layout.global_layers))
    if not layout.local_layers:
        return global_bytes, None
    return global_bytes, LocalLayers(kv_bytes_per_token(model, dtype, len(layout.local_layers)), layout.window)


def context_length(args: EngineArgs, model_max_len: int, num_blocks: int) -> int:
    """The engine's max_model_len: the shortest of what is asked for, the model's context, what the cache holds."""
    return min(args.max_model_len or model_max_len, model_max_len, num_blocks * args.block_size)


def context_limit(args: EngineArgs, model_max_len: int, num_blocks: int) -> str:
    """Which limit context_length's result is, for the error of a prompt that does not fit it."""
    n = context_length(args, model_max_len, num_blocks)
    if args.max_model_len == n:
        return f"engine.max_model_len is {n} tokens"
    if num_blocks * args.block_size == n < model_max_len:
        return f"the KV cache holds {n} tokens (engine.kv_cache_memory)"
    return f"the model's context window is {n} tokens"


def plan_engine(args: EngineArgs, model: ModelDescription, memory: Callable[[], tuple[int, int]] | None = None,
                target: EngineTarget | None = None, attention: BackendChoice | None = None) -> EnginePlan:
    """The plan for `args` and `model`. `memory`: on CUDA without kv_cache_memory, what gives (bytes free with the
    weights loaded, the largest step's peak): the engine measures them (gpu_memory.profile_step), `batchgen plan`
    estimates them. `target`: the device, dtype and quantization already resolved for `args` (else resolved now).
    SettingError for a setting that this model on this machine cannot honour (a budget under 2 blocks, ...)."""
    target = target or resolve_target(args.device, args.dtype, args.quantization)
    layout = kv_layout_of(model)
    cache_dtype = kv_cache_dtype(args, target)
    per_token, local = kv_group_bytes(layout, model, cache_dtype)
    budget = kv_cache_budget(args, target.device.type, memory)
    if budget is None:
        raise ValueError("on CUDA without kv_cache_memory the KV budget needs a memory figure (measured or estimated)")
    context = min(args.max_model_len or model.max_model_len, model.max_model_len)
    pool = size_kv_pool(budget[0], budget[1], per_token, args.block_size, args.max_num_seqs, context, local,
                        args.max_num_batched_tokens)
    return EnginePlan(model, target, attention, layout, per_token, pool,
                      context_length(args, model.max_model_len, pool.num_blocks),
                      context_limit(args, model.max_model_len, pool.num_blocks),
                      torch.int8 if cache_dtype == torch.int8 else None)
