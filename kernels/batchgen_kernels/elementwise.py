"""The decoder's elementwise chains behind one interface, in two implementations with the same numerics:

- `TorchElementwise`: plain torch ops, on any device; the oracle the fused kernels are tested against, and what the
  model used before they existed (transformers' order of operations: RMSNorm in fp32 then cast, rotate-half RoPE
  with the fp32 tables cast to the model's dtype).
- `FusedCpuElementwise`: the same chains as one C++ pass per token row (csrc/fused_ops_cpu.cpp), for the CPU.

`get_elementwise(device, fused)` picks one. Every function takes and returns [T, ...] tensors of one token per row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TorchElementwise:
    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, rms_norm(residual + x))."""
        hidden = residual + x
        return hidden, cls.rms_norm(hidden, weight, eps)

    @staticmethod
    def rope_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k heads of a fused qkv row ([T, (Hq + 2 Hkv) * D]) rotated by their positions' angles (cos, sin:
        fp32 tables [max_positions, D / 2]) → q [T, Hq, D], k [T, Hkv, D]."""
        tokens = qkv.shape[0]
        q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :q_size].view(tokens, num_q_heads, head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(tokens, num_kv_heads, head_dim)
        c, s = cos[positions].unsqueeze(1).to(qkv.dtype), sin[positions].unsqueeze(1).to(qkv.dtype)
        return _rotate(q, c, s), _rotate(k, c, s)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 I] (gate, then up) → silu(gate) * up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedCpuElementwise:
    """torch.ops.batchgen.* (built by cpu_build.load(), which must have succeeded)."""

    name = "fused-cpu"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.batchgen.rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.batchgen.add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def rope_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.batchgen.rope_qk(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchgen.silu_mul(gate_up)


def get_elementwise(device: torch.device | str, fused: bool = True):
    """The fused CPU kernels when asked for, on the CPU, and they build; else the torch ops."""
    if fused and torch.device(device).type == "cpu":
        from . import cpu_build
        if cpu_build.load():
            return FusedCpuElementwise
    return TorchElementwise
