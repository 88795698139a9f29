"""The GPU check's models: Llama-3 configs of real shapes (built with random weights in the run), their parameter
counts, and the floor of a decode step: its bytes read at the measured copy bandwidth or its FLOPs at the measured
matmul rate, whichever takes longer. A shape is the model inspector's description of the config (the model the
engine builds from it: models/inspector.py), its KV bytes per token the engine plan's (engine/engine_plan.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.engine_plan import kv_bytes_per_token
from batchgen.models.inspector import ModelDescription, describe_config

_LLAMA3 = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
               rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", bos_token_id=128000, eos_token_id=128001,
               initializer_range=0.02)
MODEL_CONFIGS = {  # LlamaConfig keyword arguments
    "1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
               tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
    "8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
}
MODEL_CONFIGS["tiny"] = dict(_LLAMA3, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # dry runs (--device cpu)
MODEL_NAMES = {"1b": "Llama-3.2-1B shape", "8b": "Llama-3.1-8B shape", "tiny": "tiny Llama-3 (dry runs)"}


# Bytes per number -> the dtype the KV formula is given (the floor's arithmetic counts bytes).
_DTYPE_OF_BYTES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@dataclass(frozen=True)
class ModelShape:
    """The floor's view of a model's description."""

    model: ModelDescription

    @classmethod
    def from_config(cls, c: dict) -> "ModelShape":
        """LlamaConfig keyword arguments (MODEL_CONFIGS'), described as the engine would build them."""
        from transformers import LlamaConfig

        return cls(describe_config(LlamaConfig(**c)))

    hidden = property(lambda self: self.model.hidden_size)
    layers = property(lambda self: self.model.num_layers)
    heads = property(lambda self: self.model.num_heads)
    kv_heads = property(lambda self: self.model.num_kv_heads)
    head_dim = property(lambda self: self.model.head_dim)
    intermediate = property(lambda self: self.model.intermediate_size)
    vocab = property(lambda self: self.model.vocab_size)
    tied = property(lambda self: self.model.tie_word_embeddings)

    @property
    def layer_matmul_params(self) -> int:
        """q, k, v, o, gate, up, down of one layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies by: all layers' projections and the lm_head."""
        return self.layers * self.layer_matmul_params + self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        """Every parameter, a tied LM head once (the description's count)."""
        return self.model.parameters

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return kv_bytes_per_token(self.model, _DTYPE_OF_BYTES[dtype_bytes])

    def describe(self) -> dict:
        return {"hidden": self.hidden, "layers": self.layers, "heads": self.heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "intermediate": self.intermediate, "vocab": self.vocab, "tied": self.tied}


def decode_step_cost(shape: ModelShape, batch_size: int, total_context: int, dtype_bytes: int = 2) -> dict:
    """Bytes read and FLOPs of one decode step of `batch_size` sequences whose contexts (the new token included)
    add up to total_context tokens. Weights are read once per step; of an untied embedding table only the batch's
    rows. Attention reads every context token's K and V and does 2 x 2 x heads x head_dim FLOPs on it per layer."""
    norms = (2 * shape.layers + 1) * shape.hidden
    embedding_rows = 0 if shape.tied else batch_size * shape.hidden
    weight_bytes = (shape.matmul_params + norms + embedding_rows) * dtype_bytes
    kv_bytes = total_context * shape.kv_bytes_per_token(dtype_bytes)
    matmul_flops = 2 * batch_size * shape.matmul_params
    attention_flops = 4 * shape.layers * shape.heads * shape.head_dim * total_context
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bytes": weight_bytes + kv_bytes,
            "matmul_flops": matmul_flops, "attention_flops": attention_flops, "flops": matmul_flops + attention_flops}


def decode_floor(cost: dict, copy_bandwidth: float, matmul_rate: float) -> dict:
    """The fastest a step can be: its bytes at the copy bandwidth or its FLOPs at the matmul rate, the larger."""
    memory_s, compute_s = cost["bytes"] / copy_bandwidth, cost["flops"] / matmul_rate
    return {"memory_s": memory_s, "compute_s": compute_s, "floor_s": max(memory_s, compute_s),
            "bound": "memory" if memory_s >= compute_s else "compute"}


def describe_model(key: str) -> dict:
    """What the step records about its model."""
    shape = ModelShape.from_config(MODEL_CONFIGS[key])
    return {"key": key, "name": MODEL_NAMES[key], "params": shape.num_params, "shape": shape.describe()}
