"""Everything an Engine needs before its first step, in the order it has to happen: device and dtype, tokenizer and
model, the KV cache's size, the model runner that allocates that cache, and on CUDA the decode graphs."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from batchgen_kernels import BackendChoice, choose_backend, choose_batch_invariant
from batchgen_kernels.elementwise import get_elementwise

from ..models.llama import attention_heads
from ..models.checkpoint_files import weight_files
from ..models.registry import ModelError
from ..models.loader import eos_token_ids, load_model, load_tokenizer, resolve_model
from ..models.weight_reader import checkpoint_numel
from ..models.accounting import num_parameters, weight_bytes
from ..models.packed_linear import PackedLinear, packing_supported
from ..models.upcast_linear import UpcastLinear, upcast_supported
from ..models.quantization import WEIGHT_ONLY_DTYPES
from .cpu_features import DtypeChoice, auto_cpu_dtype, w8a8_slow_reason
from .cuda_graphs import DecodeGraphRunner, padded_decode_supported
from .engine_args import EngineArgs
from .errors import SettingError
from .gpu_memory import profile_step
from .host_malloc import PrefaultedHeap, keep_step_memory, release_freed_memory, return_freed_memory_at_once
from .kernel_warmup import compile_attention_kernels, uses_triton
from .kv_pool import KVPoolSize, kv_cache_budget, size_kv_pool
from .model_runner import ModelRunner
from .sliding_window import KVLayout, LocalLayers, kv_layout

logger = logging.getLogger("batchgen")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Said at every start with a quantization (outputs change); the figures: docs/performance.md, "int8 weights".
QUANTIZATION_WARNINGS = {
    "int8": "quantization int8: weights and (on the CPU) activations in int8; on the default model this raised "
            "perplexity by ~4.5% and changed most greedy outputs (README, Performance)",
    "int8-weight-only": "quantization int8-weight-only: weights in int8, activations in the model's dtype; on the "
                        "default model (bf16) this raised perplexity by ~0.4% and changed 60% of greedy outputs "
                        "(README, Performance)"}


@dataclass
class EngineSetup:
    device: torch.device
    dtype: DtypeChoice
    attention: BackendChoice
    tokenizer: Any
    model: torch.nn.Module
    num_parameters: int  # as the checkpoint has them, a tied head once (models/accounting.py)
    weights_bytes: int  # what the model holds: parameters, buffers and packed or int8 weights
    eos_token_ids: list[int]
    kv_pool: KVPoolSize
    max_model_len: int  # the shortest of: asked for, the model's context, what the KV cache holds
    context_limit: str  # which of them it is, e.g. "engine.max_model_len is 512 tokens"
    runner: ModelRunner


def set_up(args: EngineArgs) -> EngineSetup:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    check_quantization(args.quantization, dtype, device)
    attention = choose_attention(args.attention_backend, device, args.batch_invariant)  # before the weights load
    args = dataclasses.replace(args, attention_backend=attention.name)  # from here on, the kernels chosen
    model_dir = resolve_model(args.model)
    if device.type == "cuda":  # before anything loads: a shape the kernels cannot compile is one clear error
        from transformers import AutoConfig
        check_attention_shape(args, device, dtype.dtype, AutoConfig.from_pretrained(model_dir))
    heap = prefaulted_heap(model_dir, device, dtype.dtype, args.quantization)
    try:
        tokenizer = load_tokenizer(model_dir)  # while the heap is faulted in: host_malloc.py
        logger.info("dtype %s", dtype.reason)
        pack = packing_supported(device, dtype.dtype) or upcast_supported(device, dtype.dtype)
        if heap is not None and heap.reserved:
            heap.hand_over()
        elif device.type == "cpu":  # each layer's plain copy back to the system as soon as it is freed
            return_freed_memory_at_once()
        model = load_model(model_dir, dtype.dtype, device, args.quantization, pack)
    finally:
        if heap is not None:
            heap.close()
    if args.quantization:  # said at every run, not only in the README: outputs change
        logger.warning(QUANTIZATION_WARNINGS[args.quantization])
    slow = w8a8_slow_reason() if args.quantization == "int8" and device.type == "cpu" else None
    if slow:
        logger.warning("quantization int8: %s", slow)
    if pack:
        packed = sum(isinstance(module, PackedLinear) for module in model.modules())
        upcast = sum(isinstance(module, UpcastLinear) for module in model.modules())
        if packed:
            logger.info("linear layers: oneDNN, %d weights packed", packed)
        if upcast:
            logger.info("linear layers: %d bf16 weights multiplied in fp32 (no native bf16 on this CPU)", upcast)
    if device.type == "cpu":  # the loader's freed plain copies back to the system (host_malloc.py)
        release_freed_memory()
    if args.batch_invariant:  # Linear layers that switch kernels by row count take one path (packed/upcast_linear.py)
        for module in model.modules():
            if isinstance(module, (PackedLinear, UpcastLinear)):
                module.batch_invariant = True
    model.use_elementwise(get_elementwise(device, fused=not args.enforce_eager))
    eos = eos_token_ids(model_dir, tokenizer)
    # Sizing on CUDA runs a profiling step on a throwaway cache; the runner binds the real one after it.
    layout = kv_layout(model.sliding_windows())
    pool = kv_pool_size(model, args, dtype.dtype, device, layout)
    max_model_len = context_length(args, model.max_model_len, pool.num_blocks)
    limit = context_limit(args, model.max_model_len, pool.num_blocks)
    runner = ModelRunner(model, pool, layout, dtype.dtype, device, eos, args.attention_backend)
    if device.type == "cpu":  # after the weights and the KV cache, which stay mapped apart
        keep_step_memory()
    if attention.name == "triton" and device.type == "cuda":  # the kernels chosen above
        compile_attention_kernels(model, max_model_len)  # no step of the run compiles a kernel
    if device.type == "cuda" and not args.enforce_eager:
        runner.decode_graphs = capture_decode_graphs(model, args, max_model_len, device, attention)
    return EngineSetup(device, dtype, attention, tokenizer, model, num_parameters(model), weight_bytes(model), eos,
                       pool, max_model_len, limit, runner)


def prefaulted_heap(model_dir, device: torch.device, dtype: torch.dtype,
                    quantization: str | None) -> PrefaultedHeap | None:
    """On the CPU, the heap for the weights to come, faulted in beside the tokenizer's loading; not for int8
    weights, which take a fraction of what is read (the rest would be resident until the load ends)."""
    if device.type != "cpu" or quantization is not None:
        return None
    try:
        numel = checkpoint_numel(weight_files(model_dir))
    except (OSError, ValueError, ModelError):  # load_model says what is wrong with the checkpoint
        return None
    return PrefaultedHeap(numel * dtype.itemsize)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SettingError("device", "device: cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def check_quantization(quantization: str | None, dtype: DtypeChoice, device: torch.device) -> None:
    """int8-weight-only on the CPU keeps the activations in the model's dtype, and its kernel has no fast fp32 path:
    refused there with fp32 (on other devices the weight is dequantized for each matmul, in any dtype)."""
    if quantization == "int8-weight-only" and device.type == "cpu" and dtype.dtype not in WEIGHT_ONLY_DTYPES:
        name = str(dtype.dtype).removeprefix("torch.")
        raise SettingError("quantization", f"quantization int8-weight-only needs bfloat16 or float16 on the CPU, not "
                                           f"{name} ({dtype.reason}): set dtype: bfloat16 (its int8 kernel has no "
                                           f"fast float32 path), or use quantization: int8")


def resolve_dtype(name: str, device: torch.device) -> DtypeChoice:
    """The dtype asked for; for auto, bf16 on CUDA and on CPUs that compute it natively, fp32 on other CPUs."""
    if name in _DTYPES:
        return DtypeChoice(_DTYPES[name], f"{name}: set in dtype")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "bfloat16: auto on CUDA")
    return auto_cpu_dtype()


def choose_attention(name: str, device: torch.device, batch_invariant: bool = False) -> BackendChoice:
    """The attention kernels for attention_backend `name`. Where Triton cannot run (its probe kernel fails: no C
    compiler, no libcuda.so.1, ...), `auto` falls back to the torch reference after one warning naming the cause and
    the fix, and the choice says so in the run's stats; an explicit `triton` is a SettingError (exit 2). With
    batch_invariant, its own kernels (batchgen_kernels.cpu_invariant), or a SettingError where they cannot run."""
    if batch_invariant:
        if name not in ("auto", "cpu"):
            raise SettingError("batch_invariant", f"batch_invariant runs its own attention kernels (the C++ CPU "
                                                  f"ones); attention_backend {name} cannot be honoured with it: "
                                                  f"set attention_backend: auto")
        choice = choose_batch_invariant(device)
        if choice.problem is not None:
            raise SettingError("batch_invariant", choice.problem)
        logger.info("attention: %s", choice.reason)
        return choice
    try:
        choice = choose_backend(device, name)
    except ValueError as exc:  # e.g. the cpu kernels on a CUDA device
        raise SettingError("attention_backend", str(exc)) from None
    if choice.problem is not None and name == "triton":
        raise SettingError("attention_backend", f"triton cannot run on {device}: {choice.problem}; or set "
                                                "attention_backend to auto to fall back to the torch reference (much "
                                                "slower)")
    if choice.problem is not None and device.type == "cuda":
        logger.warning("attention: Triton cannot run on %s, so attention runs on the torch reference without CUDA "
                       "graphs (much slower): %s. (attention_backend: triton makes this an error)",
                       device, choice.problem)
    else:  # on the CPU, a failed C++ build has warned already
        logger.info("attention: %s", choice.reason)
    return choice


def check_attention_shape(args: EngineArgs, device: torch.device, dtype: torch.dtype, config) -> None:
    """Refuse a model whose attention the Triton kernels cannot compile, when they are the ones that would run it
    (CUDA; attention_backend auto or triton). The limits are batchgen_kernels/triton_limits.py's."""
    if device.type != "cuda" or not uses_triton(device, args.attention_backend):
        return
    from batchgen_kernels.triton_limits import unsupported_reason

    num_heads, num_kv_heads, head_dim = attention_heads(config)
    reason = unsupported_reason(head_dim, num_heads, num_kv_heads, dtype)
    if reason:
        raise SettingError("attention_backend", f"the Triton attention kernels cannot run this model on CUDA: "
                                                f"{reason}; set attention_backend: torch (the torch reference)")


def context_limit(args: EngineArgs, model_max_len: int, num_blocks: int) -> str:
    """Which limit context_length's result is, for the error of a prompt that does not fit it."""
    n = context_length(args, model_max_len, num_blocks)
    if args.max_model_len == n:
        return f"engine.max_model_len is {n} tokens"
    if num_blocks * args.block_size == n < model_max_len:
        return f"the KV cache holds {n} tokens (engine.kv_cache_memory)"
    return f"the model's context window is {n} tokens"


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one token."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def kv_group_bytes(layout: KVLayout, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> tuple[int, LocalLayers | None]:
    """K and V bytes per token of the global group's layers, and what sizing needs of the local group (None: one
    group)."""
    global_bytes = kv_bytes_per_token(len(layout.global_layers), num_kv_heads, head_dim, dtype)
    if not layout.local_layers:
        return global_bytes, None
    return global_bytes, LocalLayers(kv_bytes_per_token(len(layout.local_layers), num_kv_heads, head_dim, dtype),
                                     layout.window)


def context_length(args: EngineArgs, model_max_len: int, num_blocks: int) -> int:
    """The engine's max_model_len: the shortest of what is asked for, the model's context, what the cache holds."""
    return min(args.max_model_len or model_max_len, model_max_len, num_blocks * args.block_size)


def kv_pool_size(model: torch.nn.Module, args: EngineArgs, dtype: torch.dtype, device: torch.device,
                 layout: KVLayout | None = None) -> KVPoolSize:
    """The KV pools of `model` under `layout` (default: one group of every layer)."""
    m = model
    layout = layout or KVLayout(m.num_layers)
    bytes_per_token, local = kv_group_bytes(layout, m.num_kv_heads, m.head_dim, dtype)
    budget, source = kv_cache_budget(args, device.type, lambda: profile_step(
        m, args.max_num_batched_tokens, args.max_num_seqs, args.block_size, args.attention_backend))
    context = min(args.max_model_len or m.max_model_len, m.max_model_len)
    pool = size_kv_pool(budget, source, bytes_per_token, args.block_size, args.max_num_seqs, context, local,
                        args.max_num_batched_tokens)
    logger.info("KV cache: %d bytes/token (%d layers x 2 x %d kv heads x %d dims x %s), %d blocks of %d = %d tokens,"
                " %.2f GiB, from %s", bytes_per_token, len(layout.global_layers), m.num_kv_heads, m.head_dim, dtype,
                pool.num_blocks, args.block_size, pool.tokens, pool.bytes / 2**30, pool.reason)
    return pool


def capture_decode_graphs(model: torch.nn.Module, args: EngineArgs, max_model_len: int, device: torch.device,
                          attention: BackendChoice) -> DecodeGraphRunner | None:
    """Decode-only steps replay CUDA graphs, captured now for every bucketed batch size; None (eager) if that
    fails or the attention backend cannot run padded batches."""
    if not padded_decode_supported(device, attention.name):
        if attention.problem is None:  # else choose_attention has said it
            logger.warning("no CUDA graphs: they need the Triton attention kernels (attention: %s)", attention.reason)
        return None
    graphs = DecodeGraphRunner(model, args.block_size, args.max_num_seqs, max_model_len, device, capture=True,
                               local_group=bool(kv_layout(model.sliding_windows()).local_layers))
    try:
        graphs.capture_all()
    except Exception as exc:  # noqa: BLE001 -- eager decoding gives the same tokens, only slower
        logger.warning("no CUDA graphs, decoding eagerly: capturing them failed: %s: %s", type(exc).__name__, exc)
        return None
    return graphs
