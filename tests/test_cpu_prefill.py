"""The C++ CPU prefill kernel (csrc/paged_prefill_cpu.cpp, the `cpu` backend's prefills) against the torch reference:
whole prompts, prompts after a cached prefix, chunks, every GQA ratio and block size the engine uses, sliding
windows, caches poisoned outside the contexts (and before the windows). Skipped as a whole where the kernels cannot
be built (no compiler)."""
import pytest
import torch

from attention_cases import (WINDOWS, TOLERANCE, assert_close, forget_blocks_before_windows, make_case,
                             poison_unused_slots, window_prefill_lens)
from batchgen_kernels import AttentionMetadata, cpu_backend, reference

if not cpu_backend.available():
    pytest.skip("the C++ CPU kernels cannot be built here", allow_module_level=True)


def prefill_both(q, k_cache, v_cache, md, scale, window=None):
    """The kernel on caches poisoned (NaN) outside the contexts and before the windows, and the reference on the clean
    ones."""
    out = torch.full_like(q, float("nan"))
    k_poisoned, v_poisoned = (poison_unused_slots(cache, md, window) for cache in (k_cache, v_cache))
    cpu_backend.paged_prefills(q, k_poisoned, v_poisoned, md, scale, out, window)
    expected = torch.full_like(q, float("nan"))
    reference.paged_prefills(q, k_cache, v_cache, md, scale, expected, window)
    rows = slice(md.num_decodes, None)  # decode rows are not the prefill kernel's: both leave them as they were
    return out[rows], expected[rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_prefill_matches_reference(dtype, block_size, group, head_dim):
    # whole prompts (one shorter than a block, one on a block boundary, one across several query tiles), a prompt
    # after a cached prefix of one block and a chunk after a long prefix ending mid-block
    query_lens = [5, 2 * block_size, 75, 9, 40]
    seq_lens = [5, 2 * block_size, 75, block_size + 9, 3 * block_size + 47]
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=block_size, group=group,
                                        head_dim=head_dim, dtype=dtype, seed=block_size + group)
    assert_close(*prefill_both(q, k_cache, v_cache, md, head_dim ** -0.5))


@pytest.mark.parametrize("prefix", [0, 1, 15, 16, 17, 300])
@pytest.mark.parametrize("q_len", [1, 2, 31, 32, 33, 63, 64, 65, 130])
def test_every_length_around_the_tiles(prefix, q_len):
    """Query tiles are 32 positions and key tiles 64 keys: lengths on and around those edges, and a one-token
    'prefill' (a prompt whose prefix was all cached but its last token)."""
    q, k_cache, v_cache, md = make_case([q_len], [prefix + q_len], block_size=16, group=3, head_dim=64, seed=q_len)
    assert_close(*prefill_both(q, k_cache, v_cache, md, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_prefill_matches_reference(dtype, block_size, group, window):
    """Several sequences in one call around the window's edge (attention_cases.window_prefill_lens), with every slot
    before a sequence's first window NaN."""
    query_lens, seq_lens = window_prefill_lens(window)
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=block_size, group=group, head_dim=64,
                                        dtype=dtype, seed=window + block_size)
    got, expected = prefill_both(q, k_cache, v_cache, md, 0.125, window)
    assert torch.isfinite(got).all()
    assert_close(got, expected)


@pytest.mark.parametrize("window", [40, 64])
@pytest.mark.parametrize("prefix", [0, 17, 300])
@pytest.mark.parametrize("q_len", [1, 32, 33, 65, 130])
def test_sliding_window_around_the_tiles(window, prefix, q_len):
    """A window off and on the 64-key tiles, query tiles of 32 positions starting before and after its edge."""
    q, k_cache, v_cache, md = make_case([q_len], [prefix + q_len], block_size=16, group=3, head_dim=64, seed=q_len)
    assert_close(*prefill_both(q, k_cache, v_cache, md, 0.125, window))


def test_sliding_window_prefill_skips_the_blocks_before_it():
    """Blocks wholly before a sequence's first window are not even looked up (entries of -1 pass the checks), and a
    window no shorter than any context changes nothing, bit for bit."""
    query_lens, seq_lens = [20, 40, 130], [20, 300, 1000]
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=16, group=3, head_dim=64, seed=6)
    forgotten = forget_blocks_before_windows(md, 40, 16)
    assert (forgotten.block_tables == -1).sum() == 221 // 16 + 831 // 16
    got, _ = prefill_both(q, k_cache, v_cache, forgotten, 0.125, 40)
    expected = torch.empty_like(q)
    reference.paged_prefills(q, k_cache, v_cache, md, 0.125, expected, 40)
    assert_close(got, expected)
    full, windowed = torch.empty_like(q), torch.empty_like(q)
    cpu_backend.paged_prefills(q, k_cache, v_cache, md, 0.125, full)
    cpu_backend.paged_prefills(q, k_cache, v_cache, md, 0.125, windowed, 1000)
    assert torch.equal(windowed, full)


def test_prefills_after_decodes_leave_the_decode_rows_alone():
    q, k_cache, v_cache, md = make_case([1, 1, 20, 33], [9, 40, 20, 50], group=3, head_dim=64, seed=5)
    out = torch.full_like(q, 7.0)
    cpu_backend.paged_prefills(q, k_cache, v_cache, md, 0.125, out)
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))
    expected = torch.empty_like(q)
    reference.paged_prefills(q, k_cache, v_cache, md, 0.125, expected)
    assert_close(out[2:], expected[2:])


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_long_prompt_split_across_threads(threads, window):
    """Too few (sequence, kv head) pairs for the threads: the query rows are cut into parts, each packing its own
    keys (under a window, from its own first row's window). Same answer whatever the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k_cache, v_cache, md = make_case([300], [300], num_kv_heads=1, group=4, head_dim=64, seed=11)
        assert_close(*prefill_both(q, k_cache, v_cache, md, 0.125, window))
    finally:
        torch.set_num_threads(before)


def test_strided_query_and_an_fp32_query_over_a_bf16_cache():
    """q as the model hands it over (a view into the fused projection's output), and a dtype pairing the kernel does
    not take (served by the reference)."""
    q, k_cache, v_cache, md = make_case([12, 40], [30, 40], group=3, head_dim=64, seed=2)
    wide = torch.randn(q.shape[0], q.shape[1] + 2, q.shape[2])
    wide[:, :q.shape[1]] = q
    assert_close(*prefill_both(wide[:, :q.shape[1]], k_cache, v_cache, md, 0.125))
    out = torch.empty_like(q)
    cpu_backend.paged_prefills(q, k_cache.bfloat16(), v_cache.bfloat16(), md, 0.125, out)
    expected = torch.empty_like(q)
    reference.paged_prefills(q, k_cache.bfloat16(), v_cache.bfloat16(), md, 0.125, expected)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


def test_the_comparison_catches_a_wrong_block_or_position():
    """The tolerances have teeth: a block read from the wrong place, or a context one token shorter (every query
    shifted by one position), changes the output."""
    q, k_cache, v_cache, md = make_case([30], [70], block_size=16, group=3, head_dim=64, seed=4)
    expected = torch.empty_like(q)
    reference.paged_prefills(q, k_cache, v_cache, md, 0.1, expected)
    unused = sorted(set(range(k_cache.shape[0])) - set(md.block_tables.flatten().tolist()))[0]
    redirected = md.block_tables.clone()
    redirected[0, 1] = unused
    for wrong in (AttentionMetadata(**{**md.__dict__, "block_tables": redirected}),
                  AttentionMetadata(**{**md.__dict__, "seq_lens": md.seq_lens - 1})):
        out = torch.empty_like(q)
        cpu_backend.paged_prefills(q, k_cache, v_cache, wrong, 0.1, out)
        assert not torch.allclose(out, expected, **TOLERANCE[torch.float32])


def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    q, k_cache, v_cache, md = make_case([10, 20], [30, 20], block_size=16, seed=1)
    out = torch.empty_like(q)
    op = torch.ops.batchgen.paged_prefill_
    bad_table = md.block_tables.clone()
    bad_table[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, k_cache, v_cache, bad_table, md.seq_lens, md.query_start_loc, 0, 0.125, -1, out)
    with pytest.raises(RuntimeError, match="new tokens and a context"):  # more new tokens than context
        op(q, k_cache, v_cache, md.block_tables, torch.tensor([30, 19], dtype=torch.int32), md.query_start_loc, 0,
           0.125, -1, out)
    with pytest.raises(RuntimeError, match="block table"):  # a context longer than the table
        op(q, k_cache, v_cache, md.block_tables, torch.tensor([33, 20], dtype=torch.int32), md.query_start_loc, 0,
           0.125, -1, out)
    with pytest.raises(RuntimeError, match="outside q"):
        op(q[:25], k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0, 0.125, -1, out[:25])
    with pytest.raises(RuntimeError, match="contiguous tensor"):
        op(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0, 0.125, -1, out.transpose(0, 1))


def test_fake_implementation_and_schema():
    q, k_cache, v_cache, md = make_case([10, 20], [30, 20], group=3, head_dim=64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.batchgen.paged_prefill_.default,
                          (q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0, 0.125, 16, out),
                          test_utils=("test_schema", "test_faketensor"))
