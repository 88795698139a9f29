"""The Triton kernels against the torch reference: on the GPU when there is one, else under Triton's interpreter.
The cases (random everywhere, shuffled block tables, sliding windows) come from attention_cases.py."""
import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has set TRITON_INTERPRET=1

import attention_cases  # noqa: E402
from attention_cases import (WINDOWS, TOLERANCE, BlockTables, assert_close,  # noqa: E402
                             forget_blocks_before_windows, poison_unused_slots, window_decode_lens, window_prefill_lens)
from batchgen_kernels import AttentionMetadata, reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def tb():
    from batchgen_kernels import triton_backend
    return triton_backend


def make_metadata(query_lens, seq_lens, tables, device=DEVICE):
    return attention_cases.make_metadata(query_lens, seq_lens, tables, device)


def make_case(query_lens, seq_lens, **kwargs):
    return attention_cases.make_case(query_lens, seq_lens, device=DEVICE, **kwargs)


# ---------------------------------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_same_slots_as_the_reference(tb, block_size, cache_dtype):
    query_lens, seq_lens = [1, 1, 20, 9], [17, 33, 20, 40]
    _, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=block_size, dtype=cache_dtype)
    gen = torch.Generator().manual_seed(1)
    num_tokens, kv_heads, dim = md.slot_mapping.shape[0], k_cache.shape[2], k_cache.shape[3]
    # K and V as the model hands them over: views into one fused projection, not contiguous across heads.
    fused = torch.randn(num_tokens, 3 * kv_heads * dim, generator=gen).to(DEVICE, cache_dtype)
    key = fused[:, kv_heads * dim:2 * kv_heads * dim].view(num_tokens, kv_heads, dim)
    value = fused[:, 2 * kv_heads * dim:].view(num_tokens, kv_heads, dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_ref, v_ref, md.slot_mapping)
    tb.store_kv(key, value, k_cache, v_cache, md.slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_leaves_the_cache_alone_for_negative_slots(tb):
    _, k_cache, v_cache, md = make_case([3], [3], head_dim=64)
    key = torch.randn(3, k_cache.shape[2], 64, device=DEVICE)
    slots = md.slot_mapping.clone()
    slots[1] = -1
    k_before, v_before = k_cache.clone(), v_cache.clone()
    tb.store_kv(key, key, k_cache, v_cache, slots)
    flat = k_cache.view(-1, *k_cache.shape[2:])
    assert torch.equal(flat[slots[[0, 2]]], key[[0, 2]])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[[0, 2]]] = False
    assert torch.equal(flat[untouched], k_before.view_as(flat)[untouched])
    assert torch.equal(v_cache.view_as(flat)[untouched], v_before.view_as(flat)[untouched])


# ------------------------------------------------------------------------------------------------------ decode

@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_decode_matches_reference(tb, block_size, group, head_dim):
    # Contexts of one token, exactly one block, one past a block, and several blocks.
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    q, k_cache, v_cache, md = make_case([1] * 5, seq_lens, block_size=block_size, group=group, head_dim=head_dim)
    expected = reference.paged_attention(q, k_cache, v_cache, md, head_dim ** -0.5)
    assert_close(tb.paged_attention(q, k_cache, v_cache, md, head_dim ** -0.5), expected)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_over_long_contexts_matches_reference(tb, num_splits, dtype):
    # Each context cut by its own length: 1,100 tokens in 3 splits of 384 or 5 of 256 (the last one ends mid-split,
    # 3 of 8 stay empty); the 5-token sequence fills one split and leaves the others empty.
    seq_lens = [5, 130, 300, 1100]
    q, k_cache, v_cache, md = make_case([1] * 4, seq_lens, block_size=16, group=4, head_dim=64, dtype=dtype)
    out = tb.paged_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.max_seq_len, 0.125,
                          num_splits=num_splits)
    expected = reference.paged_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.max_seq_len, 0.125)
    assert_close(out, expected)


def test_decode_splits_follow_the_batch_and_each_sequence_s_real_length():
    """The split choice, as pure functions: the grid from the batch and the SMs (capped by the longest context the
    call may see), each sequence's cut from its own length. An H200 (132 SMs) decoding one Llama-3-8B sequence (8 KV
    heads) in a CUDA graph captured for the 131,072-token context gets 32 splits; a 2,000-token context fills 8 of
    them (64 programs), where a cut sized from max_model_len (4,096 tokens a split) left it in one (8 programs)."""
    from batchgen_kernels.triton_decode import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, choose_num_splits, split_size

    def splits_used(seq_len, num_splits):
        return -(-seq_len // split_size(seq_len, num_splits))

    graph_splits = choose_num_splits(1, 8, 131072, sms=132)
    assert graph_splits == MAX_SPLITS
    assert split_size(2000, graph_splits) == MIN_TOKENS_PER_SPLIT and splits_used(2000, graph_splits) == 8
    assert splits_used(8000, graph_splits) == 32  # every split: 256 programs for 132 SMs
    assert split_size(100_000, graph_splits) == 49 * 64 and splits_used(100_000, graph_splits) == 32
    assert splits_used(5, graph_splits) == 1 and split_size(5, 1) == MIN_TOKENS_PER_SPLIT
    assert split_size(1100, 3) == 384 and splits_used(1100, 3) == 3  # whole 64-token tiles, evenly
    # About two programs per SM: larger batches need fewer splits, and an eager step's real longest context caps them.
    assert choose_num_splits(4, 8, 131072, sms=132) == 9
    assert choose_num_splits(64, 8, 131072, sms=132) == 1
    assert choose_num_splits(1, 8, 300, sms=132) == 2
    # A sliding window caps them as a short context does: only its keys are cut.
    assert choose_num_splits(1, 8, 131072, sms=132, window=512) == 2
    assert choose_num_splits(1, 8, 131072, sms=132, window=100) == 1


@pytest.mark.parametrize("window", [None, 600])
@pytest.mark.parametrize("num_splits", [3, 8])
def test_the_kernel_cuts_each_context_as_split_size_says(tb, num_splits, window):
    """split_size is what the kernel computes on the device: a split holds tokens (a finite running max) exactly when
    split_size puts some of the sequence's visible context (its window's, under one) in it."""
    from batchgen_kernels.triton_decode import decode_partials, split_size, visible_len

    seq_lens = [5, 300, 1100, 2000]
    q, k_cache, v_cache, md = make_case([1] * 4, seq_lens, block_size=16, group=2, head_dim=16)
    part_max, _, _ = decode_partials(q, k_cache, v_cache, md.block_tables, md.seq_lens, 0.1, torch.empty_like(q),
                                     num_splits, window)
    holds_tokens = torch.isfinite(part_max).all(dim=1)  # [sequence, split], every query head alike
    for row, seq_len in enumerate(seq_lens):
        seq_len = visible_len(seq_len, window)
        expected = [split * split_size(seq_len, num_splits) < seq_len for split in range(num_splits)]
        assert holds_tokens[row].tolist() == expected, (seq_len, holds_tokens[row].tolist())


def test_decode_with_head_dim_128_and_one_kv_head(tb):
    q, k_cache, v_cache, md = make_case([1, 1], [40, 100], block_size=32, num_kv_heads=1, group=8, head_dim=128)
    out = tb.paged_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.max_seq_len, 0.1, num_splits=2)
    assert_close(out, reference.paged_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, 100, 0.1))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_of_an_empty_padding_sequence_gives_zeros(tb, num_splits):
    """A CUDA-graph batch padded with zero-length sequences: their rows are 0, not NaN, and the others unchanged."""
    q, k_cache, v_cache, md = make_case([1, 1], [70, 70], block_size=16, group=3, head_dim=64)
    seq_lens = torch.tensor([70, 0], dtype=torch.int32, device=DEVICE)
    out = tb.paged_decode(q, k_cache, v_cache, md.block_tables, seq_lens, 70, 0.125, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[:1], reference.paged_decode(q[:1], k_cache, v_cache, md.block_tables[:1], seq_lens[:1], 70,
                                                 0.125))


def poisoned_before_windows(k_cache, v_cache, md, window, block_size):
    """The caches with NaN wherever no query may look (before the windows too), and md with the block-table entries
    of the blocks wholly before the windows set to -1: a kernel that reads either shows it."""
    return (poison_unused_slots(k_cache, md, window), poison_unused_slots(v_cache, md, window),
            forget_blocks_before_windows(md, window, block_size))


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", WINDOWS[1:])
def test_sliding_window_decode_matches_reference(tb, num_splits, dtype, group, window):
    """Contexts shorter than, equal to and 40 times the window, its cut into splits: only the window is read."""
    q, k_cache, v_cache, md = make_case([1] * 6, window_decode_lens(window), block_size=16, group=group, head_dim=64,
                                        dtype=dtype, seed=window)
    k_bad, v_bad, md_bad = poisoned_before_windows(k_cache, v_cache, md, window, 16)
    out = tb.paged_decode(q, k_bad, v_bad, md_bad.block_tables, md.seq_lens, md.max_seq_len, 0.125,
                          num_splits=num_splits, window=window)
    assert torch.isfinite(out).all()
    assert_close(out, reference.paged_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.max_seq_len,
                                             0.125, window))


# ----------------------------------------------------------------------------------------------------- prefill

@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_prefill_with_cached_prefixes_matches_reference(tb, block_size, group, head_dim):
    # A whole prompt; a short chunk after a prefix ending mid-block; a chunk after exactly one cached block;
    # a long chunk crossing blocks after a prefix.
    query_lens = [21, 7, 33, 40]
    seq_lens = [21, 7 + block_size + 3, 33 + block_size, 40 + 2 * block_size + 1]
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=block_size, group=group, head_dim=head_dim)
    expected = reference.paged_attention(q, k_cache, v_cache, md, head_dim ** -0.5)
    assert_close(tb.paged_attention(q, k_cache, v_cache, md, head_dim ** -0.5), expected)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (16, 32), (32, 16)])
def test_prefill_tiles_smaller_than_the_query(tb, block_m, block_n):
    # Several query tiles per sequence, key tiles smaller and larger than a block, one prefix not tile-aligned.
    query_lens, seq_lens = [45, 30], [45, 30 + 37]
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=16, group=3, head_dim=64)
    out = tb.paged_prefill(q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, first_seq=0,
                           num_seqs=2, max_query_len=md.max_query_len, scale=0.125, block_m=block_m, block_n=block_n)
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, md, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_prefill_matches_reference(tb, dtype, window):
    """Several sequences around the window's edge in one launch (attention_cases.window_prefill_lens), 16-row query
    tiles so that several start past the first row's window, NaN and -1 table entries before the windows."""
    query_lens, seq_lens = window_prefill_lens(window)
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=16, group=3, head_dim=64, dtype=dtype,
                                        seed=window)
    k_bad, v_bad, md_bad = poisoned_before_windows(k_cache, v_cache, md, window, 16)
    out = tb.paged_prefill(q, k_bad, v_bad, md.query_start_loc, md.seq_lens, md_bad.block_tables, first_seq=0,
                           num_seqs=len(seq_lens), max_query_len=md.max_query_len, scale=0.125, block_m=16,
                           block_n=32, window=window)
    assert torch.isfinite(out).all()
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, md, 0.125, window))


# ------------------------------------------------------------------------------------------ the whole interface

@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_step_stores_then_attends_like_the_reference(tb, block_size, dtype):
    """What one layer does in a step mixing decodes with prefills, some of them after a cached prefix."""
    query_lens = [1, 1, 1, 19, 5, 2 * block_size]
    seq_lens = [2, block_size + 1, 70, 19, 5 + block_size, 2 * block_size + 9]
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=block_size, group=3, head_dim=80,
                                        dtype=dtype, seed=3)
    key = torch.randn(q.shape[0], k_cache.shape[2], k_cache.shape[3], device=DEVICE).to(dtype)
    value = torch.randn_like(key)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_ref, v_ref, md.slot_mapping)
    expected = reference.paged_attention(q, k_ref, v_ref, md, 80 ** -0.5)
    tb.store_kv(key, value, k_cache, v_cache, md.slot_mapping)
    out = tb.paged_attention(q, k_cache, v_cache, md, 80 ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_step_matches_the_reference_and_a_wide_one_changes_nothing(tb, dtype):
    """A step mixing decodes with prefills under a window of 40 (the launch sizes of paged_attention); and a window
    no shorter than any context gives the full-attention output bit for bit."""
    query_lens, seq_lens = [1, 1, 1, 30, 50], [20, 41, 600, 30, 250]
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=16, group=3, head_dim=64, dtype=dtype, seed=4)
    k_bad, v_bad, md_bad = poisoned_before_windows(k_cache, v_cache, md, 40, 16)
    out = tb.paged_attention(q, k_bad, v_bad, md_bad, 0.125, 40)
    assert torch.isfinite(out).all()
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, md, 0.125, 40))
    assert torch.equal(tb.paged_attention(q, k_cache, v_cache, md, 0.125, 600),
                       tb.paged_attention(q, k_cache, v_cache, md, 0.125))


def test_the_comparison_catches_a_wrong_block_or_context(tb):
    """The tolerances above have teeth: one block read from the wrong place, or one token less of context,
    changes the output of the last row of every sequence (the row that sees the whole context)."""
    query_lens, seq_lens = [1, 1, 12, 6], [40, 70, 12 + 5, 6 + 30]
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=16)
    expected = reference.paged_attention(q, k_cache, v_cache, md, 0.1)
    assert_close(tb.paged_attention(q, k_cache, v_cache, md, 0.1), expected)

    unused = sorted(set(range(k_cache.shape[0])) - set(md.block_tables.flatten().tolist()))[0]
    redirected = md.block_tables.clone()
    redirected[:, 1] = unused  # every sequence here has at least two blocks
    wrong_block = AttentionMetadata(**{**md.__dict__, "block_tables": redirected})
    shorter = AttentionMetadata(**{**md.__dict__, "seq_lens": md.seq_lens - 1})
    last_rows = (md.query_start_loc[1:] - 1).tolist()
    for wrong in (wrong_block, shorter):
        out = tb.paged_attention(q, k_cache, v_cache, wrong, 0.1)
        for row in last_rows:
            assert not torch.allclose(out[row], expected[row], **TOLERANCE[torch.float32])


# ------------------------------------------------------------------------------------------- inside the model

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compares the backends inside the model")
def test_model_on_triton_matches_model_on_reference():
    """A tiny bf16 Llama with GQA on the GPU: prefill, then a step mixing decodes with a chunk after a prefix."""
    from transformers import LlamaConfig

    from batchgen.models.registry import build_model
    from batchgen_kernels import triton_backend

    config = LlamaConfig(vocab_size=500, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = build_model(config).to(DEVICE, torch.bfloat16).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    block_size = 16
    tables = BlockTables([80, 40, 60], block_size, torch.Generator().manual_seed(0))

    def run(backend, steps):
        shape = (tables.num_blocks, block_size, model.num_kv_heads, model.head_dim)
        caches = [torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(2 * model.num_layers)]
        model.bind_kv_cache(caches[0::2], caches[1::2])
        for layer in model.model.layers:
            layer.self_attn.attn.backend = backend
        outputs = []
        for query_lens, seq_lens, ids in steps:
            md = make_metadata(query_lens, seq_lens, tables)
            positions = torch.cat([torch.arange(s - n, s) for n, s in zip(query_lens, seq_lens)]).to(DEVICE)
            with torch.inference_mode():
                outputs.append(model(ids.to(DEVICE), positions, md))
        return outputs

    gen = torch.Generator().manual_seed(1)
    steps = [([50, 40, 30], [50, 40, 30], torch.randint(0, 500, (120,), generator=gen)),
             ([1, 1, 30], [51, 41, 60], torch.randint(0, 500, (32,), generator=gen))]
    for got, want in zip(run(triton_backend, steps), run(reference, steps)):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
