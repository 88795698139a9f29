"""LoRA applied per row in a batch: the base projection once for every row, then each row's adapter's low-rank
product (Punica/S-LoRA's batched LoRA), never a merged copy of the base.

Every LoraLinear holds `num_slots` adapter slots, each `rank` rows of one stacked A ([slots * rank, in]) and of one
stacked B ([slots * rank, out]), in the model's dtype; slot s (1, 2, ...) owns rows (s - 1) * rank .. s * rank, and
slot 0 is the base model (no rows). A packed projection (q/k/v in one matrix, gate/up in one) keeps each part's A
rows one after the other in its slot, and each part's B (its scale folded in) under that part's output columns,
zeros elsewhere: one x @ A.T and one @ B per slot reach every part.

The rows of one step arrive grouped by slot (`LoraContext.segments`: start, end, slot), set before each forward.
Two ways to the same sum on a CPU. A step of few rows (decodes) takes one product over every slot, each row's
other slots' columns zeroed (x @ A_all.T, masked, then @ B_all): two matmuls whatever the number of adapters,
where a call costs more than its work. A larger step (prefill chunks) takes each segment's own two products: a row
does only its own adapter's work, which is what costs there. Measured on a 2-core AMX Xeon, decode steps of 128
rows over 4 adapters in bf16 ran at 0.66x of the base model's with the first, 0.58x with the second (docs/
performance.md, issue 42). On CUDA, a Triton kernel (batchgen_kernels/triton_lora.py): every row's own slot's
product in two launches, from each row's slot (`LoraContext.row_slots`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# Steps of at most this many rows (decodes) take the one product over every slot; larger ones each segment's own.
DENSE_MAX_ROWS = 512

@dataclass
class LoraContext:
    """What every LoraLinear of a model reads at each forward: the step's rows by adapter slot."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (first row, end row, slot); slot 0: base
    _masks: dict = field(default_factory=dict, repr=False)  # (rank, slots, device, dtype) -> the step's row mask
    _slots: dict = field(default_factory=dict, repr=False)  # (device, slots kept) -> the step's row slots

    def set_segments(self, segments: list[tuple[int, int, int]]) -> None:
        self.segments = segments
        self._masks.clear()
        self._slots.clear()

    def row_mask(self, rank: int, num_slots: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[rows, num_slots * rank]: 1 in each row's own slot's columns, 0 elsewhere (and everywhere for slot 0)."""
        key = (rank, num_slots, device, dtype)
        mask = self._masks.get(key)
        if mask is None:
            rows = self.segments[-1][1] if self.segments else 0
            mask = torch.zeros(rows, num_slots * rank, dtype=dtype)
            for start, end, slot in self.segments:
                if slot:
                    mask[start:end, (slot - 1) * rank:slot * rank] = 1
            mask = self._masks[key] = mask.to(device)
        return mask

    def row_slots(self, device: torch.device, keep: frozenset[int]) -> torch.Tensor:
        """[rows] int32: each row's slot, 0 for slot 0 and for a slot not in `keep` (one that leaves the
        projection as the base has it), on `device`, once per step: the Triton kernel's input."""
        key = (device, keep)
        slots = self._slots.get(key)
        if slots is None:
            rows = self.segments[-1][1] if self.segments else 0
            slots = torch.zeros(rows, dtype=torch.int32)
            for start, end, slot in self.segments:
                if slot in keep:
                    slots[start:end] = slot
            slots = self._slots[key] = slots.to(device)
        return slots


class LoraLinear(nn.Module):
    """A base projection (any module: nn.Linear, PackedLinear, Int8Linear, ...) plus per-slot low-rank deltas."""

    def __init__(self, base: nn.Module, context: LoraContext, part_sizes: list[int], num_slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        """part_sizes: each part's output size, in layout order; rank: the most rank rows an adapter's parts take
        together (at most its rank times the parts)."""
        super().__init__()
        self.base = base
        self.context = context
        self.part_sizes = part_sizes
        self.num_slots, self.rank = num_slots, rank
        size_in = getattr(base, "in_features", None) or base.weight.shape[1]
        self.register_buffer("a", torch.zeros(num_slots * rank, size_in, dtype=dtype, device=device), False)
        self.register_buffer("b", torch.zeros(num_slots * rank, sum(part_sizes), dtype=dtype, device=device), False)
        self.loaded: dict[int, list[tuple[int, int, int, int]]] = {}  # slot -> its parts' (first rank row, end
        # rank row, first column, end column), for the slots holding an adapter that changes this projection

    def load(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> None:
        """Put an adapter in `slot` (1 ..): per part (a [r, in], b [out, r], scale), or None where it leaves a part
        as the base has it."""
        rows = slice((slot - 1) * self.rank, slot * self.rank)
        self.a[rows] = 0
        self.b[rows] = 0
        first_column = rank = 0
        laid = []
        for size, part in zip(self.part_sizes, parts):
            if part is not None:
                a, b, scale = part
                r = a.shape[0]
                if rank + r > self.rank:
                    raise ValueError(f"an adapter of rank {rank + r} in a slot of rank {self.rank}")
                self.a[rows][rank:rank + r] = a
                self.b[rows][rank:rank + r, first_column:first_column + size] = (b * scale).T
                laid.append((rank, rank + r, first_column, first_column + size))
                rank += r
            first_column += size
        if laid:
            self.loaded[slot] = laid
        else:
            self.loaded.pop(slot, None)

    def unload(self, slot: int) -> None:
        rows = slice((slot - 1) * self.rank, slot * self.rank)
        self.a[rows] = 0  # a step's rows of this slot add nothing (the one product over every slot reads them)
        self.b[rows] = 0
        self.loaded.pop(slot, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        segments = [s for s in self.context.segments if s[2] in self.loaded and s[0] < s[1]]
        if not segments:
            return out
        # the step's tokens as rows, whatever leading dimensions the caller uses (the generic path's [1, T, ...])
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        delta = _triton_lora_delta(self.rank, x.dtype) if x.is_cuda else None
        if delta is not None:  # on CUDA, every slot's rows in two launches (triton_lora.py)
            row_slots = self.context.row_slots(x.device, frozenset(slot for _, _, slot in segments))
            delta(flat_x, self.a, self.b, row_slots, self.num_slots, self.rank, flat_out)
        elif len(segments) > 1 and flat_x.shape[0] <= DENSE_MAX_ROWS:
            low = (flat_x @ self.a.T).mul_(self.context.row_mask(self.rank, self.num_slots, x.device, x.dtype))
            flat_out.addmm_(low, self.b)
        else:
            for start, end, slot in segments:
                first = (slot - 1) * self.rank
                used = first + self.loaded[slot][-1][1]  # the slot's own rank rows
                flat_out[start:end].addmm_(flat_x[start:end] @ self.a[first:used].T, self.b[first:used])
        return out


def _triton_lora_delta(rank: int, dtype: torch.dtype):
    """batchgen_kernels.triton_lora.lora_delta where it takes slots of this rank in this dtype; None where it does
    not, or Triton cannot be imported (then the torch products above run, on CUDA too)."""
    try:
        from batchgen_kernels import triton_lora
    except ImportError:
        return None
    return triton_lora.lora_delta if triton_lora.unsupported_reason(rank, dtype) is None else None
