"""The grouped MoE kernel (batchgen_kernels/triton_moe.py) against models/moe.py's run_experts on the same weights:
on the GPU when there is one, else under Triton's interpreter (conftest sets TRITON_INTERPRET=1), at tiny shapes."""
import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has set TRITON_INTERPRET=1

from batchgen.models.moe import MoeSettings, SparseMoeBlock, _stack_weights, route, run_experts  # noqa: E402
from batchgen_kernels.elementwise import TorchElementwise  # noqa: E402
from batchgen_kernels.triton_moe import align_by_expert, block_m_for, grouped_experts, padded_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN, INTERMEDIATE = 32, 64


def make_block(num_experts: int, top_k: int, dtype: torch.dtype, fp32_weights: bool = False,
               seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    settings = MoeSettings(num_experts, top_k, INTERMEDIATE, normalize_top_k=True, fp32_weights=fp32_weights)
    return SparseMoeBlock(HIDDEN, settings).to(DEVICE, dtype).eval()


def stacked(block: SparseMoeBlock) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.stack([e.gate_up_proj.weight for e in block.experts]),
            torch.stack([e.down_proj.weight for e in block.experts]))


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:  # fp32 accumulation both ways; only the order of the sums differs
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:  # an intermediate rounded the other way in bf16 moves the output by a few ulps
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("num_tokens", [1, 5, 33, 65])  # 65 x 2 rows over 4 experts: 64-row blocks
@pytest.mark.parametrize("num_experts, top_k", [(4, 1), (4, 2), (8, 2)])
@pytest.mark.parametrize("dtype, fp32_weights", [(torch.float32, False), (torch.bfloat16, False),
                                                 (torch.bfloat16, True)])  # Mixtral: fp32 routing weights
@torch.inference_mode()
def test_grouped_experts_equals_run_experts(num_tokens, num_experts, top_k, dtype, fp32_weights):
    block = make_block(num_experts, top_k, dtype, fp32_weights)
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(dtype)
    weights, expert_ids = route(block.gate(x), block.settings)
    assert weights.dtype == (torch.float32 if fp32_weights else dtype)
    expected = run_experts(block.experts, x, weights, expert_ids, TorchElementwise)
    got = grouped_experts(x, *stacked(block), weights, expert_ids, TorchElementwise.silu_mul)
    assert_same(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_experts_without_tokens_and_an_empty_step(dtype):
    """Every token on experts 1 and 6 of 8 (the others get no block), then no tokens at all."""
    block = make_block(8, 2, dtype, seed=1)
    x = torch.randn(7, HIDDEN, device=DEVICE).to(dtype)
    expert_ids = torch.tensor([[1, 6], [6, 1]] * 3 + [[6, 1]], device=DEVICE)
    weights = torch.rand(7, 2, device=DEVICE).to(dtype)
    expected = run_experts(block.experts, x, weights, expert_ids, TorchElementwise)
    assert_same(grouped_experts(x, *stacked(block), weights, expert_ids, TorchElementwise.silu_mul), expected)
    sorted_ids, block_experts, num_blocks = align_by_expert(expert_ids, 8, 16)
    assert num_blocks.item() == 2 and block_experts[:2].tolist() == [1, 6]
    empty = x[:0]
    got = grouped_experts(empty, *stacked(block), weights[:0], expert_ids[:0], TorchElementwise.silu_mul)
    assert got.shape == (0, HIDDEN) and got.dtype == dtype


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m",
                         [(1, 1, 4, 16), (1, 8, 128, 16), (5, 2, 8, 16), (33, 2, 4, 16), (100, 2, 4, 64),
                          (300, 8, 16, 64), (3, 2, 4, 64)])
def test_align_by_expert_invariants(num_tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(num_tokens * 7 + top_k)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 3  # uneven loads: some experts idle
    expert_ids = torch.topk(logits, top_k, dim=-1).indices.to(DEVICE)
    num_rows = num_tokens * top_k
    sorted_ids, block_experts, num_blocks = align_by_expert(expert_ids, num_experts, block_m)
    assert sorted_ids.dtype == block_experts.dtype == num_blocks.dtype == torch.int32
    size = padded_rows(num_rows, num_experts, block_m)
    assert sorted_ids.shape == (size,) and size % block_m == 0 and size >= num_rows + num_experts * (block_m - 1)
    assert block_experts.shape == (size // block_m,) and num_blocks.shape == (1,)

    flat = expert_ids.reshape(-1).cpu()
    ids, owners, used = sorted_ids.cpu(), block_experts.cpu(), int(num_blocks.item())
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == sum(-(-int(c) // block_m) for c in counts)  # whole blocks per expert; none for an idle one
    real = ids[ids < num_rows]
    assert sorted(real.tolist()) == list(range(num_rows))  # every row once; the rest is padding (== num_rows)
    assert (ids[ids >= num_rows] == num_rows).all()
    assert (ids[used * block_m:] == num_rows).all() and (owners[used:] == -1).all()
    blocks = ids[:used * block_m].view(used, block_m)
    assert (owners[:used] >= 0).all() and (owners[:used][1:] >= owners[:used][:-1]).all()  # ascending experts
    for block, owner in zip(blocks, owners[:used].tolist()):
        rows = block[block < num_rows]
        assert len(rows) and (flat[rows.long()] == owner).all()  # a block's rows are all its expert's
    for expert in range(num_experts):  # each expert's rows in slot order, as run_experts' stable sort has them
        rows = blocks[owners[:used] == expert].reshape(-1)
        rows = rows[rows < num_rows]
        assert rows.tolist() == sorted(rows.tolist()) and len(rows) == counts[expert]


def test_block_size_follows_the_rows_per_expert():
    assert block_m_for(8 * 2, 8) == 16 and block_m_for(32 * 128 - 1, 128) == 16
    assert block_m_for(32 * 8, 8) == 64


@torch.inference_mode()
def test_stacked_expert_weights_are_the_linears_own():
    """What SparseMoeBlock.stack_experts does on CUDA, on this device: each Linear's weight becomes a view into the
    stacked tensors (one copy), the values unchanged, and grouped_experts over them equals the Linears' path."""
    block = make_block(4, 2, torch.float32, seed=2)
    before = [(e.gate_up_proj.weight.clone(), e.down_proj.weight.clone()) for e in block.experts]
    gate_up = _stack_weights([e.gate_up_proj for e in block.experts])
    down = _stack_weights([e.down_proj for e in block.experts])
    assert gate_up.shape == (4, 2 * INTERMEDIATE, HIDDEN) and down.shape == (4, HIDDEN, INTERMEDIATE)
    for index, (expert, (gu, d)) in enumerate(zip(block.experts, before)):
        assert expert.gate_up_proj.weight.data_ptr() == gate_up[index].data_ptr()
        assert expert.down_proj.weight.data_ptr() == down[index].data_ptr()
        assert torch.equal(expert.gate_up_proj.weight, gu) and torch.equal(expert.down_proj.weight, d)
    x = torch.randn(9, HIDDEN, device=DEVICE)
    weights, expert_ids = route(block.gate(x), block.settings)
    expected = run_experts(block.experts, x, weights, expert_ids, TorchElementwise)
    assert_same(grouped_experts(x, gate_up, down, weights, expert_ids, TorchElementwise.silu_mul), expected)
    assert block.stack_experts() == (DEVICE.type == "cuda")  # off CUDA the block keeps run_experts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the block takes the grouped path on CUDA tensors only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_block_runs_its_experts_grouped_on_cuda(dtype):
    """Never run here (no GPU): the block's first CUDA forward stacks its experts (the Linears' weights views into
    the stacks) and its output equals run_experts' over the same weights."""
    block = make_block(8, 2, dtype, seed=3)
    x = torch.randn(17, HIDDEN, device=DEVICE).to(dtype)
    weights, expert_ids = route(block.gate(x), block.settings)
    expected = run_experts(block.experts, x, weights, expert_ids, TorchElementwise)
    assert_same(block(x, TorchElementwise), expected)
    gate_up, down = block._stacked
    assert all(e.gate_up_proj.weight.data_ptr() == gate_up[i].data_ptr() for i, e in enumerate(block.experts))
    assert all(e.down_proj.weight.data_ptr() == down[i].data_ptr() for i, e in enumerate(block.experts))
