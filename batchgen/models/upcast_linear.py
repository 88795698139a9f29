"""bf16 Linear layers on a CPU without native bf16 matmuls (no AVX512_BF16, no AMX: AVX2-only CPUs), where oneDNN
cannot pack bf16 and torch's bf16 matmul is a slow fallback: a 1B model's prefill ran at ~15 GFLOP/s against ~110 in
fp32 on the same AVX2 CPU (docs/performance.md, "Issue 24").

The weight stays bf16, the memory the dtype promises. A call with at least UPCAST_MIN_ROWS rows multiplies in fp32,
a slice of the weight widened at a time: bf16 values are exact in fp32 and the products are summed in fp32, as a
native bf16 kernel sums them, and the result is rounded to bf16 once. Fewer rows (decode at small batches, bound by
reading the weight) stay on torch's bf16 kernel, which reads half the bytes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .packed_linear import PACK_HINT_ROWS, packed_linear_rows

UPCAST_MIN_ROWS = 32  # from here on fp32 beat torch's bf16 kernel on a 1B matmul (2048 -> 16,384; docs/performance.md)
SLICE_BYTES = 32 << 20  # the widened slice of the weight: bounded, whatever the layer's size


def upcast_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU whose oneDNN has no bf16 kernels (packed_linear.packing_supported says no)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and \
        not torch.ops.mkldnn._is_mkldnn_bf16_supported()


class UpcastLinear(nn.Module):
    """`y = x @ W.T + b` for bf16 x and W, computed in fp32 for calls of UPCAST_MIN_ROWS rows or more."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = _parameter(weight)  # this very parameter: a tied head's is the embedding table's
        self.bias = None if bias is None else _parameter(bias)
        self.slice_rows = max(1, SLICE_BYTES // (4 * max(1, self.in_features)))
        self.batch_invariant = False  # every call in fp32, so that a row's result does not depend on the row count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if rows < UPCAST_MIN_ROWS and not self.batch_invariant:
            return F.linear(x, self.weight, self.bias)
        x32 = x2.float()
        out = torch.empty(rows, self.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, self.out_features, self.slice_rows):
            end = min(start + self.slice_rows, self.out_features)
            bias = None if self.bias is None else self.bias[start:end].float()
            out[:, start:end] = _linear_fp32(x32, self.weight[start:end].float(), bias, self.batch_invariant)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype=bfloat16, compute=fp32"


def _linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
    """MKL's matmul (F.linear), or where the result must not depend on the row count, oneDNN's on the slice packed
    for it: MKL gives a row other bits in calls of 1-3, 5-7 and 9-11 rows than in larger ones, and which of them
    depends on the thread count; oneDNN's packed kernel gives every row the same bits from 2 rows on at 1 and 2
    threads, and a single row is computed as two (docs/architecture.md, "Batch invariance")."""
    if not invariant:
        return F.linear(x, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS)
    return packed_linear_rows(x, packed, bias, batch_invariant=True)


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor.detach(), requires_grad=False)
