"""Everything an Engine needs before its first step, in the order it has to happen: device and dtype, the model's
description (models/inspector.py), tokenizer and model, the engine plan (engine_plan.py: the KV cache's size, the
context), the model runner that allocates that cache, and on CUDA the decode graphs."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from batchgen_kernels import BackendChoice, choose_backend, choose_batch_invariant
from batchgen_kernels.elementwise import get_elementwise

from ..models.inspector import CheckpointHeaders, ModelDescription, describe_model, read_checkpoint_headers
from ..models.registry import GENERIC, NATIVE, ModelError, native_architecture, task_refusal
from ..models.loader import engine_model_dir, eos_token_ids, load_model, load_tokenizer
from ..models.accounting import num_parameters, weight_bytes
from ..models.moe import SparseMoeBlock
from ..models.packed_linear import PackedLinear, packing_supported
from ..models.quantization import Int8Linear, weight_only_kernel_rows
from ..models.upcast_linear import UpcastLinear, upcast_supported
from .cpu_features import DtypeChoice
from .cuda_graphs import DecodeGraphRunner, padded_decode_supported
from .engine_args import EngineArgs
from .engine_plan import EnginePlan, plan_engine, resolve_target
from .errors import SettingError
from .gpu_memory import profile_step
from .host_malloc import PrefaultedHeap, keep_step_memory, release_freed_memory, return_freed_memory_at_once
from .kernel_warmup import compile_attention_kernels, uses_triton
from .kv_pool import KVPoolSize
from .model_runner import ModelRunner
from .speculative import Speculator
from .speculative.draft import load_draft

logger = logging.getLogger("batchgen")

# Said at every start with a quantization (outputs change); the figures: docs/performance.md, "int8 weights".
QUANTIZATION_WARNINGS = {
    "int8": "quantization int8: weights and (on the CPU) activations in int8; on the default model this raised "
            "perplexity by ~4.5% and changed 35% of the labeling job's greedy labels; check with `batchgen plan "
            "--quality N` (README, Performance)",
    "int8-weight-only": "quantization int8-weight-only: weights in int8, activations in the model's dtype; on the "
                        "default model (bf16) this raised perplexity by ~0.4% and changed 60% of greedy outputs "
                        "(README, Performance)"}


@dataclass
class EngineSetup:
    plan: EnginePlan  # device, dtype, attention kernels, KV pool, context: each with why (engine_plan.py)
    tokenizer: Any
    model: torch.nn.Module
    num_parameters: int  # as the checkpoint has them, a tied head once (models/accounting.py)
    weights_bytes: int  # what the model holds: parameters, buffers and packed or int8 weights
    eos_token_ids: list[int]
    runner: ModelRunner
    model_dir: Any = None  # the resolved model directory (a pooled model's sentence-transformers files: pooler.py)
    adapters: Any = None  # lora.attach.AdapterSlots with EngineArgs.lora, else None
    speculator: Speculator | None = None  # with EngineArgs.speculative

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def dtype(self) -> DtypeChoice:
        return self.plan.dtype

    @property
    def attention(self) -> BackendChoice:
        return self.plan.attention

    @property
    def kv_pool(self) -> KVPoolSize:
        return self.plan.kv_pool

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    @property
    def context_limit(self) -> str:
        return self.plan.context_limit


def set_up(args: EngineArgs) -> EngineSetup:
    target = resolve_target(args.device, args.dtype, args.quantization)  # device, dtype, quantization's verdict
    device, dtype = target.device, target.dtype
    attention = choose_attention(args.attention_backend, device, args.batch_invariant)  # before the weights load
    args = dataclasses.replace(args, attention_backend=attention.name)  # from here on, the kernels chosen
    model_dir = engine_model_dir(args.model, args.task)
    checkpoint = read_headers(model_dir)
    # Started before transformers is imported (the config's reading does): its faulting overlaps that and the
    # tokenizer's loading.
    heap = prefaulted_heap(checkpoint, device, dtype.dtype, args.quantization)
    try:
        description = inspect_model(model_dir, checkpoint, args.model_impl)  # None: load_model says what is wrong with it
        check_task(args, model_dir, checkpoint, description)
        adapters = read_lora(args, description) if description is not None else None  # before the weights load
        if description is not None:  # before anything loads: a shape the kernels cannot compile is one clear error
            check_attention_shape(args, device, dtype.dtype, description)
        tokenizer = load_tokenizer(model_dir)  # while the heap is faulted in: host_malloc.py
        logger.info("dtype %s", dtype.reason)
        pack = packing_supported(device, dtype.dtype) or upcast_supported(device, dtype.dtype)
        if heap is not None and heap.reserved:
            heap.hand_over()
        elif device.type == "cpu":  # each layer's plain copy back to the system as soon as it is freed
            return_freed_memory_at_once()
        model = load_model(model_dir, dtype.dtype, device, args.quantization, pack, args.model_impl,
                           args.quantization_keep, args.quantization_scales)
    finally:
        if heap is not None:
            heap.close()
    if device.type == "cuda":  # the experts stacked for the grouped kernel before the profiling step sizes the cache
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                module.stack_experts()
    if args.quantization:  # said at every run, not only in the README: outputs change
        logger.warning(QUANTIZATION_WARNINGS[args.quantization])
        if args.quantization_keep:
            logger.info("quantization int8: kept in %s: %s", dtype.name, ", ".join(args.quantization_keep))
    else:
        stored = next((module for module in model.modules() if isinstance(module, Int8Linear)), None)
        if stored is not None:  # a converted GGUF: int8 as stored, whatever the job's quantization (gguf_int8.py)
            activations = "int8 (W8A8)" if stored.activations == "dynamic_int8" else \
                f"{str(dtype.dtype).removeprefix('torch.')} (weight-only)"
            logger.info("weights: int8 as the GGUF's conversion stores them, %s activations", activations)
    if target.quantization_note:
        logger.warning("quantization int8: %s", target.quantization_note)
    if pack:
        packed = sum(isinstance(module, PackedLinear) for module in model.modules())
        upcast = sum(isinstance(module, UpcastLinear) for module in model.modules())
        if packed:
            logger.info("linear layers: oneDNN, %d weights packed", packed)
        if upcast:
            logger.info("linear layers: %d bf16 weights multiplied in fp32 (no native bf16 on this CPU)", upcast)
    if args.batch_invariant:  # Linear layers that switch kernels by row count take one path (packed/upcast_linear.py,
        # quantization.py)
        for module in model.modules():
            if isinstance(module, PackedLinear):
                module.make_batch_invariant()
            elif isinstance(module, (UpcastLinear, Int8Linear)):
                module.batch_invariant = True
        amx = sum(isinstance(module, PackedLinear) and module.kernel == "amx" for module in model.modules())
        if amx:
            logger.info("batch-invariant linear layers: %d bf16 weights repacked for the AMX Linear's tiles", amx)
    if device.type == "cpu":  # the loader's freed plain copies back to the system (host_malloc.py)
        release_freed_memory()
    model.use_elementwise(get_elementwise(device, fused=not args.enforce_eager))
    eos = eos_token_ids(model_dir, tokenizer)
    if description is None:  # the checkpoint loaded, so its config and headers read now
        description = describe_model(model_dir, model_impl=args.model_impl)
        check_attention_shape(args, device, dtype.dtype, description)
        adapters = read_lora(args, description)
    loaded = attach_lora(model, adapters, description, args.max_loras, dtype.dtype, device) if adapters else None
    # Sizing on CUDA runs a profiling step on a throwaway cache; the runner binds the real one after it.
    plan = plan_engine(args, description, lambda: profile_step(
        model, args.max_num_batched_tokens, args.max_num_seqs, args.block_size, args.attention_backend),
        target, attention)
    log_kv_pool(plan)
    max_model_len = plan.max_model_len
    runner = ModelRunner(model, plan.kv_pool, plan.kv_layout, plan.cache_dtype, device, eos, args.attention_backend)
    if loaded is not None:
        runner.lora_slots = loaded
    if device.type == "cpu":  # after the weights and the KV cache, which stay mapped apart
        keep_step_memory()
    if attention.name == "triton" and device.type == "cuda":  # the kernels chosen above
        compile_attention_kernels(model, max_model_len)  # no step of the run compiles a kernel
    # The generic path's transformers code may sync with the host inside a step (an MoE's routing by expert, say),
    # which a CUDA graph cannot capture: its decode steps run eagerly.
    if device.type == "cuda" and not args.enforce_eager and plan.model.path == NATIVE and args.task == "generate" \
            and loaded is None:  # a step's adapters are not part of a captured graph
        runner.decode_graphs = capture_decode_graphs(model, args, max_model_len, device, attention,
                                                     bool(plan.kv_layout.local_layers))
    speculator = None
    if args.speculative is not None:
        draft = None
        if args.speculative.method == "draft":
            draft = load_draft(args, plan.kv_pool.num_blocks, dtype.dtype, device, pack, tokenizer, model.vocab_size)
        speculator = Speculator(args.speculative, max_model_len, draft, weight_only_kernel_rows(model))
    # A draft model's weights and its KV cache are held beside the model's (the memory bound counts them)
    draft_bytes = speculator.draft_bytes if speculator is not None else 0
    return EngineSetup(plan, tokenizer, model, num_parameters(model), weight_bytes(model) + draft_bytes, eos, runner,
                       model_dir, loaded, speculator)


def read_lora(args: EngineArgs, description):
    """EngineArgs.lora's adapters, read and checked against the base model (SettingError lora); None without."""
    if not args.lora:
        return None
    from batchgen.lora import AdapterError, BaseShape
    from batchgen.lora.attach import read_adapters

    if args.task != "generate":
        raise SettingError("lora", f"lora adapters apply to task generate, not {args.task}")
    try:
        return read_adapters(args.lora, BaseShape.of(description), args.max_loras)
    except AdapterError as exc:
        raise SettingError("lora", str(exc)) from None


def attach_lora(model: torch.nn.Module, checked, description, max_loras: int, dtype: torch.dtype,
                device: torch.device):
    from batchgen.lora import BaseShape
    from batchgen.lora.attach import attach

    try:
        loaded = attach(model, checked, BaseShape.of(description), dtype, device)
    except ValueError as exc:
        raise SettingError("lora", str(exc)) from None
    logger.info("lora: %d adapters (%s), %d resident at once (max_loras %d), %.1f MiB", len(checked.sources),
                ", ".join(checked.sources), loaded.num_slots, max_loras, loaded.nbytes / 2**20)
    return loaded


def check_task(args: EngineArgs, model_dir, checkpoint: CheckpointHeaders | None,
               description: ModelDescription | None) -> None:
    """SettingError naming `task` where the model has no head for it (classify without a `score` head, generate or
    score on a classifier or a base model), or its path cannot load one (the generic path: causal LMs only)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return  # load_model says what is wrong with it
    if description is not None:
        path = description.path
    else:
        path = NATIVE if native_architecture(config) is not None and args.model_impl != "transformers" else GENERIC
    why = task_refusal(args.task, config, None if checkpoint is None else checkpoint.entries, path)
    if why is not None:
        raise SettingError("task", why)


def read_headers(model_dir) -> CheckpointHeaders | None:
    """The checkpoint's safetensors headers, or None where they cannot be read (load_model says why)."""
    try:
        return read_checkpoint_headers(model_dir)
    except (OSError, ValueError, ModelError):
        return None


def inspect_model(model_dir, checkpoint: CheckpointHeaders | None, model_impl: str = "auto") -> ModelDescription | None:
    """The model's description (models/inspector.py), or None where its config or headers cannot be read: then
    load_model, which reads the same, says what is wrong with them."""
    if checkpoint is None:
        return None
    try:
        return describe_model(model_dir, checkpoint=checkpoint, model_impl=model_impl)
    except (OSError, ValueError, KeyError, TypeError, ModelError):
        return None


def prefaulted_heap(checkpoint: CheckpointHeaders | None, device: torch.device, dtype: torch.dtype,
                    quantization: str | None) -> PrefaultedHeap | None:
    """On the CPU, the heap for the weights to come (every number the checkpoint holds, at `dtype`), faulted in
    beside the config's and the tokenizer's loading; not for int8 weights, which take a fraction of what is read
    (the rest would be resident until the load ends)."""
    if device.type != "cpu" or quantization is not None or checkpoint is None or \
            any(entry["dtype"] == "I8" for entry in checkpoint.entries.values()):  # a converted GGUF's int8
        return None
    return PrefaultedHeap(checkpoint.numel * dtype.itemsize)


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


def check_attention_shape(args: EngineArgs, device: torch.device, dtype: torch.dtype, model: ModelDescription) -> None:
    """Refuse a model whose attention the Triton kernels cannot compile, when they are the ones that would run it
    (CUDA; attention_backend auto or triton). The limits are batchgen_kernels/triton_limits.py's."""
    if device.type != "cuda" or not uses_triton(device, args.attention_backend):
        return
    from batchgen_kernels.triton_limits import unsupported_reason

    reason = unsupported_reason(model.head_dim, model.num_heads, model.num_kv_heads, dtype)
    if reason:
        raise SettingError("attention_backend", f"the Triton attention kernels cannot run this model on CUDA: "
                                                f"{reason}; set attention_backend: torch (the torch reference)")


def log_kv_pool(plan: EnginePlan) -> None:
    pool, model = plan.kv_pool, plan.model
    element = "int8 + an fp32 scale per kv head" if plan.kv_dtype == torch.int8 else str(plan.dtype.dtype)
    logger.info("KV cache: %d bytes/token (%d layers x 2 x %d kv heads x %d dims x %s), %d blocks of %d = %d tokens,"
                " %.2f GiB, from %s", plan.kv_bytes_per_token, len(plan.kv_layout.global_layers), model.num_kv_heads,
                model.head_dim, element, pool.num_blocks, pool.block_size, pool.tokens, pool.bytes / 2**30,
                pool.reason)


def capture_decode_graphs(model: torch.nn.Module, args: EngineArgs, max_model_len: int, device: torch.device,
                          attention: BackendChoice, local_group: bool = False) -> DecodeGraphRunner | None:
    """Decode-only steps replay CUDA graphs, captured now for every bucketed batch size; None (eager) if that
    fails or the attention backend cannot run padded batches."""
    if not padded_decode_supported(device, attention.name):
        if attention.problem is None:  # else choose_attention has said it
            logger.warning("no CUDA graphs: they need the Triton attention kernels (attention: %s)", attention.reason)
        return None
    graphs = DecodeGraphRunner(model, args.block_size, args.max_num_seqs, max_model_len, device, capture=True,
                               local_group=local_group)
    try:
        graphs.capture_all()
    except Exception as exc:  # noqa: BLE001 -- eager decoding gives the same tokens, only slower
        logger.warning("no CUDA graphs, decoding eagerly: capturing them failed: %s: %s", type(exc).__name__, exc)
        return None
    return graphs
