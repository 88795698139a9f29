"""The int8 KV cache's kernels (engine.kv_cache_dtype: int8): the C++ quantizing store, decode and prefill against
the torch reference on the same int8 caches, and the reference's int8 attention against the unquantized one.
Skipped as a whole where the C++ kernels cannot be built."""
import pytest
import torch

from attention_cases import (WINDOWS, assert_close, forget_blocks_before_windows, int8_case, poison_unused_slots,
                             window_decode_lens, window_prefill_lens)
from batchgen_kernels import cpu_backend, cpu_invariant, reference

if not cpu_backend.available():
    pytest.skip("the C++ CPU kernels cannot be built here", allow_module_level=True)


def both(q, k8, v8, scales, md, scale, window=None, backend=cpu_backend):
    """The kernel with NaN scales wherever no query may look (a read of them poisons the row), and the reference."""
    poisoned = tuple(poison_unused_slots(s, md, window) for s in scales)
    got = backend.paged_attention(q, k8, v8, md, scale, window, kv_scales=poisoned)
    return got, reference.paged_attention(q, k8, v8, md, scale, window, kv_scales=scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_quantizes_as_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    key, value = (torch.randn(37, 3, 64, generator=gen).mul(4).to(dtype) for _ in range(2))
    key[5, 1] = 0  # an all-zero row: scale 0, values 0
    slots = torch.randperm(8 * 16, generator=gen)[:37]
    caches = [[torch.zeros(8, 16, 3, 64, dtype=torch.int8) for _ in range(2)] +
              [torch.zeros(8, 16, 3) for _ in range(2)] for _ in range(2)]
    for store, (kc, vc, ks, vs) in zip((cpu_backend.store_kv, reference.store_kv), caches):
        store(key, value, kc, vc, slots, kv_scales=(ks, vs))
    for got, expected in zip(*caches):
        assert torch.equal(got, expected)
    kc, _, ks, _ = caches[0]
    row = kc.view(-1, 3, 64)[slots[0]].float() * ks.view(-1, 3)[slots[0]][:, None]
    torch.testing.assert_close(row, key[0].float(), atol=key[0].float().abs().max().item() / 127, rtol=0)
    assert ks.view(-1, 3)[slots[5], 1] == 0 and not kc.view(-1, 3, 64)[slots[5], 1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (4, 128), (5, 80), (2, 72)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(dtype, group, head_dim, block_size):
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 300]
    q, k8, v8, scales, md, _ = int8_case([1] * 6, seq_lens, dtype, block_size=block_size, group=group,
                                         head_dim=head_dim, seed=group + head_dim)
    got, expected = both(q, k8, v8, scales, md, head_dim ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (4, 128), (2, 72)])
def test_mixed_step_matches_reference(dtype, group, head_dim):
    """Decodes and prefills in one step: whole prompts, a chunk after a cached prefix, a one-token prefill."""
    q, k8, v8, scales, md, _ = int8_case([1, 1, 40, 17, 1 + 0 * 0, 100][:2] + [40, 17, 100],
                                         [30, 200, 40, 90, 100], dtype, group=group, head_dim=head_dim, seed=head_dim)
    got, expected = both(q, k8, v8, scales, md, head_dim ** -0.5)
    assert_close(got, expected)


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_windows(window):
    lens = window_decode_lens(window)
    q, k8, v8, scales, md, _ = int8_case([1] * len(lens), lens, seed=window)
    md = forget_blocks_before_windows(md, window, 16)
    got, expected = both(q, k8, v8, scales, md, 0.1, window)
    assert_close(got, expected)
    query_lens, seq_lens = window_prefill_lens(window)
    q, k8, v8, scales, md, _ = int8_case(query_lens, seq_lens, seed=window + 1)
    md = forget_blocks_before_windows(md, window, 16)
    got, expected = both(q, k8, v8, scales, md, 0.1, window)
    assert_close(got, expected)


def test_batch_invariant_kernel_reads_int8():
    """batch_invariant's kernel (every row a prefill) on an int8 cache: a row's output is the same bits alone and in
    a batch, and matches the reference."""
    q, k8, v8, scales, md, _ = int8_case([1, 1, 33], [50, 130, 80], seed=7)
    together = cpu_invariant.paged_attention(q, k8, v8, md, 0.125, kv_scales=scales)
    assert_close(together, reference.paged_attention(q, k8, v8, md, 0.125, kv_scales=scales))
    q1, _, _, _, md1, _ = int8_case([1], [130], seed=7)
    md1.block_tables = md.block_tables[1:2].clone()
    alone = cpu_invariant.paged_attention(q[1:2], k8, v8, md1, 0.125, kv_scales=scales)
    assert torch.equal(alone, together[1:2])


def test_int8_attention_is_close_to_the_unquantized():
    """What the int8 cache costs in accuracy: attention over it against attention over the bf16 cache it came from
    (random K/V: every key about as likely as any other, the hardest case for a rounding of the scores)."""
    q, k8, v8, scales, md, (kc, vc) = int8_case([1] * 4 + [64], [10, 100, 500, 2000, 300], seed=3, group=3,
                                                head_dim=64)
    got = cpu_backend.paged_attention(q, k8, v8, md, 0.125, kv_scales=scales)
    exact = reference.paged_attention(q, kc, vc, md, 0.125)
    error = (got.float() - exact.float()).norm() / exact.float().norm()
    assert error < 0.03, error


@pytest.mark.parametrize("window", [None, 40])
def test_amx_prefill_reads_int8(window):
    """bf16 prefills on AMX tiles over an int8 cache (its rows dequantized to bf16 as they are packed), where this CPU
    has AMX: against the reference on the same int8 cache."""
    from batchgen_kernels import amx
    if not amx.available():
        pytest.skip(f"no AMX here: {amx.status().reason}")
    q, k8, v8, scales, md, _ = int8_case([1, 40, 17, 100], [30, 40, 90, 300], group=3, head_dim=64, seed=11)
    out = torch.empty_like(q)
    torch.ops.batchgen.paged_prefill_amx_int8_(q, k8, v8, *scales, md.block_tables, md.seq_lens, md.query_start_loc,
                                               md.num_decodes, 0.125, -1 if window is None else window, out)
    expected = reference.paged_attention(q, k8, v8, md, 0.125, window, kv_scales=scales)
    assert_close(out[1:], expected[1:])


@pytest.mark.parametrize("head_dim", [64, 80])
def test_the_layer_turns_q_and_k_over_an_int8_cache_so_outlier_channels_cost_less(head_dim):
    """batchgen.models.attention: over an int8 cache the layer multiplies q and k by an orthonormal Hadamard matrix.
    Keys with a few large channels (as trained models' keys have) lose most of their small channels to a per-token
    int8 scale unturned; turned, the error falls."""
    from attention_cases import BlockTables, make_metadata
    from batchgen.models.attention import Attention, hadamard

    rotation = hadamard(head_dim, torch.device("cpu"))
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(head_dim), atol=1e-6, rtol=0)
    lens, kv_heads, heads = [37, 120], 2, 6
    gen = torch.Generator().manual_seed(0)
    tables = BlockTables(lens, 16, gen)
    md = make_metadata(lens, lens, tables)
    q, k, v = (torch.randn(sum(lens), n, head_dim, generator=gen) for n in (heads, kv_heads, kv_heads))
    k[..., :3] *= 25

    def attend(dtype, turned=True):
        layer = Attention(heads, kv_heads, head_dim, head_dim ** -0.5)
        shape = (tables.num_blocks, 16, kv_heads, head_dim)
        scales = (torch.zeros(shape[:3]), torch.zeros(shape[:3])) if dtype == torch.int8 else None
        layer.bind_kv_cache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), "torch", scales)
        assert (layer.rotation is not None) == (dtype == torch.int8)
        if not turned:
            layer.rotation = None
        return layer(q, k, v, md)

    exact = attend(torch.float32)
    error = {turned: ((attend(torch.int8, turned) - exact).norm() / exact.norm()).item() for turned in (True, False)}
    assert error[True] < 0.5 * error[False], error
