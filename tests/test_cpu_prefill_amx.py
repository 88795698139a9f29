"""The AMX prefill kernel (csrc/amx/paged_prefill_amx.cpp, torch.ops.batchgen.paged_prefill_amx_) against the torch
reference, in bf16: whole prompts, prompts after a cached prefix, chunks, GQA ratios, block sizes, head dims on and off
the tiles' 32, lengths around the 16-row tiles and the 32-position / 64-key tiles, sliding windows, and caches
poisoned (NaN) outside the contexts and before the windows.

On a CPU with AMX (amx.status()) the tile instructions run. Elsewhere the module is skipped, unless the same kernel
built on the tiles' scalar emulation (amx.EMULATED) is already loaded: tests/test_cpu_kernels_amx.py runs this module
that way on every CPU, so the kernel's packing, tiling and softmax are tested where there is no AMX."""
import pytest
import torch

from attention_cases import WINDOWS, assert_close, make_case, poison_unused_slots, window_prefill_lens
from batchgen_kernels import amx, choose_backend, cpu_backend, reference
from batchgen_kernels.metadata import kernel_window


def emulated_tiles_loaded() -> bool:
    try:
        return torch.ops.batchgen.amx_tiles_emulated()
    except (AttributeError, RuntimeError):  # no such op: the library is not loaded
        return False


if not amx.available() and not emulated_tiles_loaded():
    pytest.skip(f"no AMX tiles here ({amx.status().reason}); tests/test_cpu_kernels_amx.py runs these cases on the "
                "tiles' emulation", allow_module_level=True)


def prefill_both(q, k_cache, v_cache, md, scale, window=None):
    """The AMX kernel on caches poisoned outside the contexts and before the windows, the reference on clean ones."""
    out = torch.full_like(q, float("nan"))
    k_poisoned, v_poisoned = (poison_unused_slots(cache, md, window) for cache in (k_cache, v_cache))
    torch.ops.batchgen.paged_prefill_amx_(q, k_poisoned, v_poisoned, md.block_tables, md.seq_lens,
                                          md.query_start_loc, md.num_decodes, scale, kernel_window(window), out)
    expected = torch.full_like(q, float("nan"))
    reference.paged_prefills(q, k_cache, v_cache, md, scale, expected, window)
    rows = slice(md.num_decodes, None)
    return out[rows], expected[rows]


def case(query_lens, seq_lens, **kwargs):
    return make_case(query_lens, seq_lens, dtype=torch.bfloat16, **kwargs)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_amx_prefill_matches_reference(block_size, group, head_dim):
    # whole prompts (shorter than a block, on a block boundary, across query tiles), a prompt after a cached prefix
    # of one block and a chunk after a long prefix ending mid-block
    query_lens = [5, 2 * block_size, 75, 9, 40]
    seq_lens = [5, 2 * block_size, 75, block_size + 9, 3 * block_size + 47]
    q, k_cache, v_cache, md = case(query_lens, seq_lens, block_size=block_size, group=group, head_dim=head_dim,
                                   seed=block_size + group)
    assert_close(*prefill_both(q, k_cache, v_cache, md, head_dim ** -0.5))


@pytest.mark.parametrize("head_dim", [32, 48, 96, 256])
@pytest.mark.parametrize("group", [2, 8])
def test_head_dims_on_and_off_the_tiles(head_dim, group):
    """Head dims that are multiples of the tiles' 32 (32, 96, 256) and one padded with zeros to them (48); 2 or 8
    query rows per position."""
    q, k_cache, v_cache, md = case([1, 70], [1, 150], group=group, head_dim=head_dim, seed=head_dim)
    assert_close(*prefill_both(q, k_cache, v_cache, md, head_dim ** -0.5))


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("prefix", [0, 1, 16, 17, 300])
@pytest.mark.parametrize("q_len", [1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 130])
def test_every_length_around_the_tiles(group, prefix, q_len):
    """Query tiles of 32 positions (group x 32 rows, in 16-row tiles: a last block of 16 or 32 rows), key tiles of 64
    keys (products over 32 at a time), and a one-token 'prefill'."""
    q, k_cache, v_cache, md = case([q_len], [prefix + q_len], block_size=16, group=group, head_dim=64, seed=q_len)
    assert_close(*prefill_both(q, k_cache, v_cache, md, 0.125))


# (window, query_lens, seq_lens): several sequences in one call around each window's edge, and single prompts and
# chunks whose query tiles start before and after the edge, with windows off and on the 64-key tiles.
WINDOW_CASES = ([(window, *window_prefill_lens(window)) for window in WINDOWS]
                + [(window, [q_len], [prefix + q_len]) for window in (40, 64) for prefix in (0, 17, 300)
                   for q_len in (1, 32, 33, 65, 130)])


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window, query_lens, seq_lens", WINDOW_CASES)
def test_sliding_windows(group, window, query_lens, seq_lens):
    q, k_cache, v_cache, md = case(query_lens, seq_lens, group=group, head_dim=64, seed=window + len(seq_lens))
    got, expected = prefill_both(q, k_cache, v_cache, md, 0.125, window)
    assert torch.isfinite(got).all()
    assert_close(got, expected)


def test_only_bf16_is_taken():
    q, k_cache, v_cache, md = make_case([5], [5], dtype=torch.float32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.batchgen.paged_prefill_amx_(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                              0, 0.125, -1, torch.empty_like(q))


@pytest.mark.skipif(not amx.available(), reason="the engine uses the AMX kernel only where the CPU has AMX")
def test_the_cpu_backend_sends_bf16_prefills_to_the_tiles():
    assert "AMX tiles" in choose_backend("cpu", "cpu").reason
    q, k_cache, v_cache, md = case([3, 40], [3, 100], seed=2)
    through_backend, direct = torch.empty_like(q), torch.empty_like(q)
    cpu_backend.paged_prefills(q, k_cache, v_cache, md, 0.125, through_backend)
    torch.ops.batchgen.paged_prefill_amx_(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                          md.num_decodes, 0.125, -1, direct)
    assert torch.equal(through_backend, direct)
