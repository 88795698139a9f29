"""What a loaded model holds, whatever form its weights take: plain parameters, oneDNN-packed (PackedLinear) or int8
(Int8Linear). Packed and int8 weights are not Parameters, so `model.parameters()` alone undercounts them."""
from __future__ import annotations

from torch import nn

from .packed_linear import PackedLinear
from .quantization import Int8Linear


def _held_weights(model: nn.Module) -> list:
    return [m.packed_weight for m in model.modules()
            if isinstance(m, (PackedLinear, Int8Linear)) and m.packed_weight is not None]


def num_parameters(model: nn.Module) -> int:
    """The model's parameter count as its checkpoint has it: a tied LM head (held as its own packed or int8 copy, or
    as the embedding itself) counted once."""
    count = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, PackedLinear):
            count += module.in_features * module.out_features
        elif isinstance(module, Int8Linear):
            count += module.in_features * module.out_features  # its qweight, or once packed, packed_weight
    head, embedding = model.output_head, model.input_embeddings.weight
    if model.head_tied and getattr(head, "weight", None) is not embedding:
        count -= embedding.numel()  # the head is a copy of the table: once
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct tensor the model holds as weights (parameters, buffers, packed weights; a shared one
    once), the RoPE tables excluded."""
    seen, total = set(), 0
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named + [("packed", t) for t in _held_weights(model)]:
        if name.startswith("rotary_emb.") or (not tensor.is_mkldnn and tensor.data_ptr() in seen):
            continue
        if not tensor.is_mkldnn:
            seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total
