"""LoRA applied per row in a batch: the base projection once for every row, then each adapter's low-rank product
on its own rows only (Punica/S-LoRA's segmented products, in torch), never a merged copy of the base.

The rows of one step arrive grouped by adapter (`LoraContext.segments`: start, end, slot), which the caller sets
before each forward; slot 0 is the base model (no adapter). A packed projection (q/k/v in one matrix, gate/up in
one) gets each part's delta in its own columns: x @ A_parts.T once for the rows, then each part's B."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

@dataclass
class LoraContext:
    """What every LoraLinear of a model reads at each forward: the step's rows by adapter slot."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (first row, end row, slot); slot 0: base


@dataclass
class SlotWeights:
    """One adapter's weights for one (packed) projection: its parts' A stacked, and each part's B with its scale
    folded in, placed at the part's output columns."""

    a: torch.Tensor  # [sum of the parts' ranks, in]
    parts: list[tuple[int, int, int, int, torch.Tensor]]  # (first column, end column, first rank, end rank, B)


class LoraLinear(nn.Module):
    """A base projection (any module: nn.Linear, PackedLinear, Int8Linear, ...) plus per-slot low-rank deltas."""

    def __init__(self, base: nn.Module, context: LoraContext, part_sizes: list[int]) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.part_sizes = part_sizes  # each part's output size, in layout order
        self.slots: dict[int, SlotWeights] = {}

    def load(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor, float] | None], dtype: torch.dtype) -> None:
        """Put an adapter in `slot`: per part (a [r, in], b [out, r], scale), or None where it leaves a part as is."""
        present = [(i, part) for i, part in enumerate(parts) if part is not None]
        if not present:
            self.slots.pop(slot, None)
            return
        starts = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        a_rows, laid, rank = [], [], 0
        for i, (a, b, scale) in present:
            a_rows.append(a)
            laid.append((starts[i], starts[i] + self.part_sizes[i], rank, rank + a.shape[0],
                         (b * scale).to(dtype).contiguous()))
            rank += a.shape[0]
        self.slots[slot] = SlotWeights(torch.cat(a_rows).to(dtype).contiguous(), laid)

    def unload(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for start, end, slot in self.context.segments:
            weights = self.slots.get(slot)
            if weights is None or start == end:
                continue
            low = x[start:end] @ weights.a.T  # [rows, sum of ranks]
            for first, last, r0, r1, b in weights.parts:
                out[start:end, first:last] += low[:, r0:r1] @ b.T
        return out
