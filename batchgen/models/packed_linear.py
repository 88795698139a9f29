"""CPU Linear layers through oneDNN, with each weight reordered ("packed") once into the kernel's blocked layout.

Why not nn.Linear: torch's default CPU matmul is MKL's, which on AMD CPUs runs an AVX2 code path. On this project's
AVX-512 machines oneDNN's fp32 kernels measured ~2.4x MKL's rate (one thread: ~250 against ~100 GFLOP/s at 64 rows),
its bf16 kernels avoid the slow single-row bf16 paths of plain `F.linear`, and a packed weight is not re-laid out on
every call. See docs/performance.md. The packed layout works for any number of rows; the hint only tunes it.

Batch-invariant bf16 where batchgen's AMX Linear loads (batchgen_kernels.amx.load_linear; not with BATCHGEN_NO_AMX)
runs on that kernel's tile path instead (csrc/amx/linear_amx.cpp): oneDNN's AMX matmul picks its blocking by the row
count and splits its sums by the thread count, the tiles sum each output over all of K in one fixed order and split
only the output columns over the threads, so a row's bits depend on neither (tests/test_linear_amx.py).
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACK_HINT_ROWS = 64  # rows the layout is tuned for (measured: any hint >= 16 gives the same speed from 1 to 1,024 rows)
# On a CPU with AMX, oneDNN's bf16 matmul picks its blocking by the row count: a row's bits differ between calls of,
# say, 40 and 600 rows (1,536->576), or 2,000 and 8,192 (576->1,536). Calls of one fixed row count agree, whatever a row's place in them: so where a row's
# result must not depend on its company and the AMX Linear does not load, bf16 on AMX runs in calls of exactly this
# many rows, the last one padded (still not the same bits at another thread count).
# 128 for a decoder, whose decode steps are small; 1,024 for an encoder, whose calls are prefills of thousands of
# rows (at 4,000 rows of all-MiniLM's shapes, 128-row calls took 1.4-2.3x one call's time, 1,024-row ones 1.0-1.2x).
AMX_INVARIANT_ROWS = 128
AMX_INVARIANT_ROWS_PREFILL = 1024
TILE_ROWS_ANY = 1 << 62  # linear_amx's tile_rows: its tile path for every row count


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN is built into torch's CPU wheels; bf16 also needs a CPU oneDNN accepts for bf16 (AVX-512 or newer)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held only in packed form (the plain weight is dropped): oneDNN's, or once
    make_batch_invariant has moved a bf16 weight there, the AMX Linear's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.batch_invariant = False  # a one-row call takes the many-row kernel too (packed_linear_rows)
        self.invariant_rows = AMX_INVARIANT_ROWS if self.dtype == torch.bfloat16 and _has_amx() else None
        self.kernel = "onednn"

    def make_batch_invariant(self, fixed_rows: int = AMX_INVARIANT_ROWS) -> None:
        """From here on a row's result depends neither on the rows sharing its call nor on the thread count. bf16
        where the AMX Linear loads: the weight moves into its tile layout (oneDNN's packed weight gives the plain
        matrix back bit for bit: to_dense) and is held only so. Elsewhere oneDNN, one row computed as two, on a CPU
        with AMX in calls of `fixed_rows` rows (the thread count still splits oneDNN's sums there: README)."""
        self.batch_invariant = True
        if self.kernel == "amx":
            return
        if self.dtype == torch.bfloat16 and _amx_linear_loads():
            self.packed_weight = torch.ops.batchgen.linear_amx_pack(self.packed_weight.to_dense())
            self.kernel = "amx"
        elif self.invariant_rows is not None:
            self.invariant_rows = fixed_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "amx":
            return torch.ops.batchgen.linear_amx(x, self.packed_weight, self.bias, self.out_features, TILE_ROWS_ANY)
        if self.batch_invariant and self.invariant_rows is not None:
            return _fixed_row_calls(x, self.packed_weight, self.bias, self.invariant_rows)
        return packed_linear_rows(x, self.packed_weight, self.bias, self.batch_invariant)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, "
                f"packed={self.kernel}")


def packed_linear_rows(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                       batch_invariant: bool) -> torch.Tensor:
    """oneDNN's packed matmul. On AVX-512 CPUs it takes another kernel (a GEMV) for a single row, whose bits differ
    from that row's in any larger call (fp32 at every shape probed, bf16 at some: dev/batch_invariance_probe.py);
    from 2 rows on a row's bits do not depend on the row count. So where they must not, one row is computed as two."""
    if batch_invariant and x.numel() == x.shape[-1]:
        pair = x.reshape(1, -1).expand(2, -1).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(pair, packed_weight, bias, "none", [], "")[:1]
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def _fixed_row_calls(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                     rows: int) -> torch.Tensor:
    """The matmul in calls of exactly `rows` rows (the last one padded with zeros): AMX_INVARIANT_ROWS."""
    x2 = x.reshape(-1, x.shape[-1])
    count = x2.shape[0]
    padded = -count % rows
    if padded:
        x2 = torch.cat([x2, x2.new_zeros(padded, x2.shape[1])])
    calls = [torch.ops.mkldnn._linear_pointwise(x2[start:start + rows], packed_weight, bias, "none", [], "")
             for start in range(0, x2.shape[0], rows)]
    out = calls[0] if len(calls) == 1 else torch.cat(calls)
    return out[:count].reshape(*x.shape[:-1], out.shape[-1])


def _has_amx() -> bool:
    from batchgen.machine import cpu_flags

    return "amx_bf16" in (cpu_flags() or set())


@functools.lru_cache(maxsize=None)  # asked once per layer: one warning where it fails
def _amx_linear_loads() -> bool:
    """batchgen's AMX Linear is built and loaded here (amx.available(): the CPU's flags, the tile state granted, no
    BATCHGEN_NO_AMX)."""
    try:
        from batchgen_kernels import amx
    except ImportError:
        return False
    if not amx.available():
        return False
    try:
        amx.load_linear()
    except Exception as exc:  # noqa: BLE001 -- oneDNN's fixed-row calls are the fallback
        logger.warning("AMX Linear unavailable, batch-invariant bf16 stays on oneDNN: %s: %s", type(exc).__name__, exc)
        return False
    return True


def pack_linears(model: nn.Module) -> int:
    """Replace every plain nn.Linear of `model` by a PackedLinear in place; returns how many. A tied LM head gets
    its own packed copy (the embedding keeps the plain matrix for its lookups)."""
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, PackedLinear(linear.weight, linear.bias))
    return len(targets)

