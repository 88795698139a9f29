"""The Triton kernels on an int8 KV cache (engine.kv_cache_dtype: int8) against the torch reference's int8 path: on
the GPU when there is one, else under Triton's interpreter (small shapes: it is slow).

The store must write the reference's bits (the same quantization rule). Decode and prefill read the same int8 cache
as the reference, so the quantization error is common to both and the tolerances are attention_cases.TOLERANCE's,
those of the compute dtype: the kernels fold the fp32 scales into the scores and the probabilities, the reference
multiplies them into the gathered K/V (rounded to bf16 there), which changes only the rounding. What int8 costs
against the unquantized cache is bounded separately (a relative error under 3%, as for the C++ kernels)."""
import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has set TRITON_INTERPRET=1

from attention_cases import (TOLERANCE, assert_close, forget_blocks_before_windows, int8_case,  # noqa: E402
                             poison_unused_slots)
from batchgen_kernels import reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def tb():
    from batchgen_kernels import triton_backend
    return triton_backend


def case(query_lens, seq_lens, dtype=torch.bfloat16, **kwargs):
    return int8_case(query_lens, seq_lens, dtype, device=DEVICE, **kwargs)


def poisoned(scales, md, window=None):
    """The scales with NaN wherever no query may look: a kernel that reads one there (even with a zero weight)
    returns NaN."""
    return tuple(poison_unused_slots(s, md, window) for s in scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_quantizes_bit_for_bit_as_the_reference(tb, dtype):
    """Random rows, an all-zero row (scale 0, values 0), a row of exact ties (absmax 127: x x 127 / absmax is x, so
    2.5 must round to 2 and 3.5 to 4, half to even as torch.round does), and a padding token (slot -1) that writes
    nothing. K and V as the model hands them over: views into one fused projection."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads, dim = 21, 2, 64
    fused = torch.randn(tokens, 3 * heads * dim, generator=gen).mul(4).to(dtype)
    key = fused[:, heads * dim:2 * heads * dim].view(tokens, heads, dim)
    value = fused[:, 2 * heads * dim:].view(tokens, heads, dim)
    key[3, 1] = 0
    ties = torch.tensor([127.0, 2.5, 3.5, -0.5, 0.5, -1.5, -2.5, 126.5])
    value[4, 0] = ties.repeat(dim // len(ties)).to(dtype)
    slots = torch.randperm(6 * 16, generator=gen)[:tokens]
    slots[7] = -1
    key, value, slots = key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE)
    caches = [[torch.zeros(6, 16, heads, dim, dtype=torch.int8, device=DEVICE) for _ in range(2)]
              + [torch.zeros(6, 16, heads, device=DEVICE) for _ in range(2)] for _ in range(2)]
    kc, vc, ks, vs = caches[0]
    tb.store_kv(key, value, kc, vc, slots, kv_scales=(ks, vs))
    keep = slots >= 0
    rc, rv, rks, rvs = caches[1]
    reference.store_kv(key[keep], value[keep], rc, rv, slots[keep], kv_scales=(rks, rvs))
    for got, expected in zip(caches[0], caches[1]):
        assert torch.equal(got, expected)
    assert vc.view(-1, heads, dim)[slots[4], 0, :8].tolist() == [127, 2, 4, 0, 0, -2, -2, 126]
    assert ks.view(-1, heads)[slots[3], 1] == 0 and not kc.view(-1, heads, dim)[slots[3], 1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits, window", [(1, None), (3, None), (3, 40)])
def test_decode_reads_int8_like_the_reference(tb, dtype, num_splits, window):
    """Contexts of one token, around a block, and long enough for three splits (and 17 windows); NaN scales and -1
    table entries wherever no query may look."""
    seq_lens = [1, 15, 17, 700]
    q, k8, v8, scales, md, _ = case([1] * 4, seq_lens, dtype, group=3, head_dim=64, seed=num_splits)
    if window is not None:
        md = forget_blocks_before_windows(md, window, 16)
    out = tb.paged_decode(q, k8, v8, md.block_tables, md.seq_lens, md.max_seq_len, 0.125, num_splits=num_splits,
                          window=window, kv_scales=poisoned(scales, md, window))
    assert torch.isfinite(out).all()
    assert_close(out, reference.paged_decode(q, k8, v8, md.block_tables.clamp(min=0), md.seq_lens, md.max_seq_len,
                                             0.125, window, kv_scales=scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_reads_int8_like_the_reference(tb, dtype, window):
    """A whole prompt and chunks after cached prefixes (one ending mid-block), several 16-row query tiles and 32-key
    tiles, a head dim padded from 80 to 128."""
    query_lens, seq_lens = [21, 7, 40], [21, 7 + 19, 40 + 33]
    q, k8, v8, scales, md, _ = case(query_lens, seq_lens, dtype, group=3, head_dim=80, seed=5)
    if window is not None:
        md = forget_blocks_before_windows(md, window, 16)
    out = tb.paged_prefill(q, k8, v8, md.query_start_loc, md.seq_lens, md.block_tables, first_seq=0, num_seqs=3,
                           max_query_len=md.max_query_len, scale=80 ** -0.5, block_m=16, block_n=32, window=window,
                           kv_scales=poisoned(scales, md, window))
    assert torch.isfinite(out).all()
    md.block_tables = md.block_tables.clamp(min=0)
    assert_close(out, reference.paged_attention(q, k8, v8, md, 80 ** -0.5, window, kv_scales=scales))


def test_a_mixed_step_stores_then_attends_like_the_reference_and_near_the_unquantized(tb):
    """One layer's step through the backend's interface: decodes and prefills, the new tokens quantized by the store
    kernel. Against the reference on the same int8 cache (stored by the reference); against attention over the bf16
    cache it came from, a relative error under 3% (random K/V: the hardest case for a rounding of the scores); and
    the V scales in the K scales' place is caught."""
    query_lens, seq_lens = [1, 1, 30, 12], [40, 300, 30, 12 + 20]
    q, k8, v8, scales, md, (kc, vc) = case(query_lens, seq_lens, group=4, head_dim=64, seed=9)
    key, value = torch.randn(2, q.shape[0], 2, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE,
                                                                                                  torch.bfloat16)
    ref = [t.clone() for t in (k8, v8, *scales)]
    reference.store_kv(key, value, ref[0], ref[1], md.slot_mapping, kv_scales=(ref[2], ref[3]))
    tb.store_kv(key, value, k8, v8, md.slot_mapping, kv_scales=scales)
    out = tb.paged_attention(q, k8, v8, md, 0.125, kv_scales=scales)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert_close(out, reference.paged_attention(q, ref[0], ref[1], md, 0.125, kv_scales=(ref[2], ref[3])))

    reference.store_kv(key, value, kc, vc, md.slot_mapping)
    exact = reference.paged_attention(q, kc, vc, md, 0.125).float()
    assert (out.float() - exact).norm() / exact.norm() < 0.03
    swapped = tb.paged_attention(q, k8, v8, md, 0.125, kv_scales=scales[::-1])
    assert not torch.allclose(swapped.float(), out.float(), **TOLERANCE[torch.bfloat16])


def test_the_scales_must_come_with_an_int8_cache(tb):
    q, k8, v8, scales, md, (kc, vc) = case([1], [20], head_dim=64)
    with pytest.raises(ValueError, match="needs its scales"):
        tb.paged_attention(q, k8, v8, md, 0.125)
    with pytest.raises(ValueError, match="come with an int8 KV cache"):
        tb.paged_attention(q, kc, vc, md, 0.125, kv_scales=scales)
