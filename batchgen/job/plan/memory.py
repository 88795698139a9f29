"""The memory arithmetic of `batchgen plan`: a run's peak memory, from the model's description (models/inspector.py:
its shape and its checkpoint's tensors, from the config and the safetensors headers), the engine settings and the
sampled prompts, without loading a weight.

On the CPU the estimate is of peak RSS, the figure a run writes as `peak_memory_bytes`:
  baseline     this process's RSS once python, torch, transformers, pyarrow, the tokenizer and the model's
               (meta-device) modules are loaded: a run holds the same before its weights;
  weights      every parameter at the run's dtype (int8 for the quantized ones with quantization: int8, and for a
               converted GGUF's, stored in int8: models/gguf_int8.py), plus
               no checkpoint pages (mapped: 0): the loader reads into memory it owns (models/weight_reader.py);
  packed       where the CPU's linear layers are packed for oneDNN (models/packed_linear.py): every matmul weight
               (the LM head too, a tied one as its own copy), each packed as soon as it is read;
  released     minus the plain matmul weights, which the packed ones replace one at a time (models/loader.py);
  KV pool      at most all of it: its pages become resident as its blocks are first used, and a long job
               uses them all (freed blocks stay cached until the never-used ones are gone);
  activations  the largest step (max_num_batched_tokens tokens), the longest prompt's attention scores, logits
               (a `choice` job's: the fp32 logits and log-softmax of a chunk of scored positions);
  sort window  the token ids of the rows sorted together.
On CUDA it is of device memory (weights, KV pool, activations), against the device's free memory."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from batchgen.models.inspector import ModelDescription

from ..keys import JobConfigError


# Measured on this project's machine (2-core EPYC, torch 2.13 CPU, the default model, fp32): the peak RSS growth of
# gpu_memory.run_dummy_step over a 16-token step was 86.5, 181.7 and 379.8 MiB for 2,048 / 4,096 / 8,192 tokens
# over 32 / 32 / 256 sequences: 1.5x the MLP's live tensors (gate/up [T, 2I], silu(gate) and the product [T, I],
# two [T, H] residuals; the allocator keeps freed chunks of other sizes), plus the logits. One whole prompt of
# 512 / 1,024 / 2,048 tokens grew it by a further 2.5x one fp32 [heads, q, k] score tensor (scores,
# probabilities, mask) on the torch attention path.
MLP_ALLOCATOR_FACTOR = 1.5
ATTENTION_SCORE_COPIES = 2.5
# Bytes a tokenized row holds per prompt token while it waits in the sort window (a list of Python ints).
WINDOW_BYTES_PER_TOKEN = 40


@dataclass(frozen=True)
class WeightBytes:
    files: int
    parameters: int
    checkpoint_dtypes: tuple[str, ...]
    loaded: int  # the parameters at the run's dtype
    mapped: int  # checkpoint pages kept resident beside copies of them (CPU)
    linear: int = 0  # of `loaded`, the matmul weights (nn.Linear's): those that packing replaces


def inspect_model(model_dir: Path, dtype: torch.dtype, on_cpu: bool, quantization: str | None = None,
                  model_impl: str = "auto") -> tuple[ModelDescription, WeightBytes]:
    """The model's description (models/inspector.py: no weights read) and its weights' bytes at the run's dtype."""
    from batchgen.models.inspector import describe_model

    try:
        model = describe_model(model_dir, model_impl=model_impl)
    except (ValueError, OSError) as exc:  # unsupported architecture, RoPE type or activation; unreadable config or
        raise JobConfigError(f"model: {exc}") from None  # header
    weights = weight_bytes(model, dtype, quantization)
    if (quantization is not None or stored_int8(model)) and model.tie_word_embeddings:
        # the embedding stays; the LM head: an int8 copy
        weights = replace(weights, loaded=weights.loaded + int8_bytes(model.vocab_size, model.hidden_size))
    if not weights.files:
        raise JobConfigError(f"model: no *.safetensors weights in {model_dir}")
    return model, weights


def int8_bytes(rows: int, columns: int) -> int:
    """An int8 matrix and its fp32 per-row scales (models/quantization.py)."""
    from batchgen.models.quantization import SCALE_BYTES
    return rows * columns + rows * SCALE_BYTES


def stored_int8(model: ModelDescription) -> bool:
    """Whether the checkpoint holds int8 matrices (a converted GGUF), which the loader keeps in int8 whatever the
    job's quantization (models/gguf_int8.py)."""
    return any(tensor.dtype == "I8" for tensor in model.tensors)


def weight_bytes(model: ModelDescription, dtype: torch.dtype, quantization: str | None = None) -> WeightBytes:
    """The bytes of the checkpoint tensors the loader reads (the description's), held at `dtype`.

    The loader reads every tensor into memory it owns and maps nothing (models/weight_reader.py), so no checkpoint
    page stays resident: `mapped` is 0. A quantized matrix [out, in] is held as int8 with a scale per output row,
    as is one the checkpoint stores in int8."""
    from batchgen.models.quantization import is_quantized

    run_bytes = torch.finfo(dtype).bits // 8
    parameters = loaded = linear = 0
    for tensor in model.tensors:
        numel = tensor.numel
        parameters += numel
        quantized = tensor.dtype == "I8" or (quantization is not None and is_quantized(tensor.parameter))
        size = int8_bytes(tensor.shape[0], numel // tensor.shape[0]) if quantized else numel * run_bytes
        loaded += size
        linear += size if tensor.linear else 0
    return WeightBytes(model.files, parameters, model.checkpoint_dtypes, loaded, 0, linear)


def released_after_packing(weights: WeightBytes, running: int) -> int:
    """The (negative) part for the plain matmul weights: the loader packs each one as soon as it is read and drops
    it (models/loader.py), so only the packed copies (and a tied head's) are ever held together. `running` is
    kept for the callers' sake: loading no longer peaks above running."""
    return -weights.linear


def packed_weight_bytes(shape: ModelDescription, dtype: torch.dtype) -> int:
    """The matmul weights (q/k/v, o, gate/up, down of every layer, and the LM head) at `dtype`; none for a
    checkpoint stored in int8, whose matmul weights all stay int8."""
    if stored_int8(shape):
        return 0
    size = torch.finfo(dtype).bits // 8
    if shape.tensors:  # the checkpoint's matmul weights as they are (MoE experts, any architecture), a tied head
        tied = shape.vocab_size * shape.hidden_size if shape.tie_word_embeddings else 0
        return (sum(tensor.numel for tensor in shape.tensors if tensor.linear) + tied) * size
    h, d = shape.hidden_size, shape.head_dim
    per_layer = h * (shape.num_heads + 2 * shape.num_kv_heads) * d + shape.num_heads * d * h \
        + 3 * h * shape.intermediate_size
    return (shape.num_layers * per_layer + shape.vocab_size * h) * torch.finfo(dtype).bits // 8


def activation_bytes(shape: ModelDescription, dtype: torch.dtype, step_tokens: int, step_seqs: int,
                     longest_prompt: int, on_cpu: bool, scored: bool = False) -> dict[str, int]:
    """The largest step's transient memory, by part: a step of `step_tokens` tokens over `step_seqs` sequences,
    and the longest prompt prefilled in chunks of at most `step_tokens` (the CPU attention's score tensors).
    `scored`: the step scores `choice` candidates, every one of its tokens a scored position."""
    from batchgen.engine.model_runner import SCORE_CHUNK

    size = torch.finfo(dtype).bits // 8
    mlp = step_tokens * (4 * shape.intermediate_size + 2 * shape.hidden_size) * size * MLP_ALLOCATOR_FACTOR
    logits = step_seqs * shape.vocab_size * 4  # fp32
    if scored:  # a chunk's fp32 logits and their log-softmax, side by side
        logits = max(logits, 2 * min(step_tokens, SCORE_CHUNK) * shape.vocab_size * 4)
    parts = {"step": int(mlp), "logits": logits}
    if on_cpu:
        query = min(longest_prompt, step_tokens)
        parts["attention"] = int(ATTENTION_SCORE_COPIES * shape.num_heads * query * longest_prompt * size)
    return parts


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"
