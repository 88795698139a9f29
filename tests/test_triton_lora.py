"""The per-row LoRA kernel (batchgen_kernels/triton_lora.py) against LoraLinear's torch products (lora_linear.py) on
the same stacked slots: on the GPU when there is one, else under Triton's interpreter (conftest sets
TRITON_INTERPRET=1), at small shapes. Rows of several slots and of the base (slot 0) interleaved, packed projections
(an adapter's parts one after the other in its slot), ranks that are not a power of two, and steps large enough for
the prefill-sized blocks and small enough for the decode's split of the input features."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has set TRITON_INTERPRET=1

from batchgen.lora import LoraContext, LoraLinear  # noqa: E402
from batchgen_kernels import triton_lora  # noqa: E402
from batchgen_kernels.triton_lora import MAX_RANK, launch_config, lora_delta, split_features  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_lora(size_in: int, part_sizes: list[int], num_slots: int, part_rank: int, dtype: torch.dtype,
              seed: int = 0) -> LoraLinear:
    """A LoraLinear over a biased Linear with every slot loaded: slot s's adapter of rank part_rank on each part,
    except that slot 2 leaves the second part (if any) to the base; A and B drawn so that each product's values are
    near 1 whatever the rank (a 16-bit low rounded an ulp the other way then moves the output by an ulp or so)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(size_in, sum(part_sizes), bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=generator) / size_in ** 0.5)
    lora = LoraLinear(base, LoraContext(), part_sizes, num_slots, part_rank * len(part_sizes), torch.float32)
    for slot in range(1, num_slots + 1):
        parts = []
        for index, size in enumerate(part_sizes):
            if slot == 2 and index == 1:
                parts.append(None)
                continue
            a = torch.randn(part_rank, size_in, generator=generator) / size_in ** 0.5
            b = torch.randn(size, part_rank, generator=generator) / part_rank ** 0.5
            parts.append((a, b, 0.5))
        lora.load(slot, parts)
    return lora.to(DEVICE, dtype)


def torch_path(lora: LoraLinear, x: torch.Tensor) -> torch.Tensor:
    """LoraLinear.forward's torch products (the CPU path: each segment's own), whatever the device."""
    if x.is_cuda:  # forward would take the kernel
        out = lora.base(x)
        for start, end, slot in lora.context.segments:
            if slot in lora.loaded and start < end:
                rows = slice((slot - 1) * lora.rank, slot * lora.rank)
                out[start:end].addmm_(x[start:end] @ lora.a[rows].T, lora.b[rows])
        return out
    return lora(x)


def kernel_path(lora: LoraLinear, x: torch.Tensor) -> torch.Tensor:
    out = lora.base(x)
    row_slots = lora.context.row_slots(x.device, frozenset(lora.loaded))
    return lora_delta(x, lora.a, lora.b, row_slots, lora.num_slots, lora.rank, out)


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:  # fp32 accumulation both ways; only the order of the sums differs
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # the same roundings (x @ A.T to the dtype, then out + low @ B once); sums in another order: a few ulps
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


LAYOUTS = {
    # decode-sized: base rows between slots, a slot's rows split by base rows, one-row segments
    "decode": [(0, 2, 1), (2, 3, 0), (3, 6, 3), (6, 7, 2), (7, 9, 0), (9, 10, 1)],
    # a block of 16 rows mixing four slots and the base; a block of only base rows, which the kernel skips
    "mixed blocks": [(0, 5, 0), (5, 9, 2), (9, 12, 1), (12, 14, 0), (14, 20, 3), (20, 40, 0), (40, 41, 1)],
    # prefill-sized (64-row shrink blocks, 32-row expand blocks): segments across block edges
    "prefill": [(0, 30, 1), (30, 33, 0), (33, 100, 2), (100, 101, 0), (101, 140, 3)],
    "one slot": [(0, 70, 2)],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_packed_qkv_slots_equal_the_torch_products(layout, dtype):
    """A packed q/k/v projection (3 parts of rank 8: slots of rank 24, rank chunks of 32 with 8 masked), 3 slots,
    slot 2 leaving k to the base: the kernel equals both torch paths; the base's rows are untouched."""
    lora = make_lora(48, [32, 16, 16], 3, 8, dtype)
    segments = LAYOUTS[layout]
    lora.context.set_segments(segments)
    x = torch.randn(segments[-1][1], 48, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    got = kernel_path(lora, x)
    assert_same(got, torch_path(lora, x))
    base = lora.base(x)
    for start, end, slot in segments:
        if slot == 0:
            assert torch.equal(got[start:end], base[start:end])
        if slot == 2:  # its adapter leaves k's columns (32:48) as the base has them
            assert torch.equal(got[start:end, 32:48], base[start:end, 32:48])


@pytest.mark.parametrize("size_in, part_sizes, part_rank, rows", [
    (600, [40], 8, 5),  # decode: the input features split over programs, partial sums added by the expand
    (600, [40], 8, 70),  # prefill-sized blocks
    (40, [100, 100], 16, 9),  # gate/up: 2 parts of 16, chunks of 32; outputs over two column blocks
    (32, [130], 40, 12),  # rank 40: a chunk of 64, 24 columns masked; 130 outputs: a partial column block
    (24, [20], 3 * 40, 66),  # rank 120: two chunks of 64, the second partial
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_ranks_splits_and_partial_tiles(size_in, part_sizes, part_rank, rows, dtype):
    lora = make_lora(size_in, part_sizes, 2, part_rank, dtype, seed=size_in + rows)
    cut = rows // 3
    lora.context.set_segments([(0, cut, 2), (cut, cut + 1, 0), (cut + 1, rows, 1)])
    x = torch.randn(rows, size_in, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    assert_same(kernel_path(lora, x), torch_path(lora, x))


def test_the_decode_splits_the_input_features():
    """What the previous test relies on: 5 rows of 600 features split, 70 rows not; splits whole BLOCK_K tiles."""
    decode, prefill = launch_config(5, 8, torch.bfloat16), launch_config(70, 8, torch.bfloat16)
    assert (decode["BLOCK_M"], decode["EXPAND_M"], prefill["BLOCK_M"], prefill["EXPAND_M"]) == (16, 16, 64, 32)
    assert split_features(5, 600, 8, decode) == 320 and split_features(4096, 600, 8, prefill) == 640
    assert split_features(5, 576, 24, decode) % decode["BLOCK_K"] == 0


@torch.inference_mode()
def test_rows_in_any_slot_order_and_a_slot_unloaded():
    """The kernel takes any per-row slots, not only rows grouped by slot: each row alone against its own slot's
    product. A slot that the projection does not hold (unloaded, its weights still in the buffers) is left out of
    row_slots, and its rows stay the base's."""
    lora = make_lora(40, [24], 4, 8, torch.float32, seed=3)
    slots = [3, 0, 1, 3, 4, 2, 0, 2, 1, 4, 4, 3, 0, 1, 2, 3, 1, 0, 2]
    lora.context.set_segments([(row, row + 1, slot) for row, slot in enumerate(slots)])
    lora.unload(4)
    x = torch.randn(len(slots), 40, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    row_slots = lora.context.row_slots(x.device, frozenset(lora.loaded))
    assert row_slots.tolist() == [0 if slot == 4 else slot for slot in slots] and row_slots.dtype == torch.int32
    got = lora_delta(x, lora.a, lora.b, row_slots, lora.num_slots, lora.rank, lora.base(x))
    assert_same(got, torch_path(lora, x))
    base = lora.base(x)
    assert all(torch.equal(got[row], base[row]) for row, slot in enumerate(slots) if slot in (0, 4))


@torch.inference_mode()
def test_base_rows_only_and_an_empty_step_leave_out_untouched():
    lora = make_lora(40, [24], 2, 8, torch.bfloat16, seed=5)
    x = torch.randn(20, 40).to(DEVICE, torch.bfloat16)
    out = lora.base(x)
    expected = out.clone()
    assert lora_delta(x, lora.a, lora.b, torch.zeros(20, dtype=torch.int32, device=DEVICE), 2, lora.rank,
                      out) is out
    assert torch.equal(out, expected)
    empty = x[:0]
    assert lora_delta(empty, lora.a, lora.b, torch.zeros(0, dtype=torch.int32, device=DEVICE), 2, lora.rank,
                      out[:0]).shape == (0, 24)


def test_row_slots_are_built_once_per_step():
    context = LoraContext()
    context.set_segments([(0, 2, 1), (2, 3, 0), (3, 5, 2)])
    first = context.row_slots(torch.device("cpu"), frozenset({1, 2}))
    assert first.tolist() == [1, 1, 0, 2, 2]
    assert context.row_slots(torch.device("cpu"), frozenset({1, 2})) is first
    assert context.row_slots(torch.device("cpu"), frozenset({2})).tolist() == [0, 0, 0, 2, 2]
    context.set_segments([(0, 1, 2)])
    assert context.row_slots(torch.device("cpu"), frozenset({1, 2})).tolist() == [2]


def test_what_the_kernel_refuses():
    x = torch.zeros(3, 16)
    assert triton_lora.unsupported_reason(MAX_RANK, torch.bfloat16) is None
    assert "ranks 1 to" in triton_lora.unsupported_reason(MAX_RANK + 1, torch.bfloat16)
    assert "dtype" in triton_lora.unsupported_reason(8, torch.int8)
    slots = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="ranks 1 to"):
        lora_delta(x, torch.zeros(MAX_RANK + 1, 16), torch.zeros(MAX_RANK + 1, 8), slots, 1, MAX_RANK + 1,
                   torch.zeros(3, 8))
    with pytest.raises(ValueError, match="for 2 slots of rank 8"):
        lora_delta(x, torch.zeros(8, 16), torch.zeros(8, 8), slots, 2, 8, torch.zeros(3, 8))
    with pytest.raises(ValueError, match="row_slots must be int32"):
        lora_delta(x, torch.zeros(8, 16), torch.zeros(8, 8), slots.long(), 1, 8, torch.zeros(3, 8))
    with pytest.raises(ValueError, match="one dtype"):
        lora_delta(x, torch.zeros(8, 16), torch.zeros(8, 8, dtype=torch.bfloat16), slots, 1, 8, torch.zeros(3, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="LoraLinear takes the kernel on CUDA tensors only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_lora_linear_runs_the_kernel_on_cuda(dtype, monkeypatch):
    """Never run here (no GPU): LoraLinear.forward on CUDA goes through lora_delta, once per call, and equals the
    torch products."""
    lora = make_lora(48, [32, 16, 16], 3, 8, dtype)
    lora.context.set_segments(LAYOUTS["mixed blocks"])
    x = torch.randn(41, 48, device=DEVICE).to(dtype)
    calls = []
    real = triton_lora.lora_delta
    monkeypatch.setattr(triton_lora, "lora_delta", lambda *args: calls.append(1) or real(*args))
    got = lora(x)
    assert calls == [1]
    assert_same(got, torch_path(lora, x))
