"""Random attention cases shared by the kernel tests (Triton and C++ CPU) and their oracle comparison.

Every cache is filled with random values everywhere, and block tables are shuffled, so a kernel that reads a wrong
slot, block or position gets different numbers, not zeros that happen to match. Sliding-window cases (Gemma 3's local
layers) come with the windows to try and the contexts around them.
"""
import torch

from batchgen_kernels import AttentionMetadata

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
             torch.float16: dict(atol=5e-3, rtol=5e-3)}


class BlockTables:
    """Each sequence's blocks, drawn from a shuffled pool (with spare blocks nobody owns), padded with 0."""

    def __init__(self, seq_lens, block_size, generator, spare=3):
        needed = [-(-s // block_size) for s in seq_lens]
        self.block_size = block_size
        self.num_blocks = sum(needed) + spare
        ids = torch.randperm(self.num_blocks, generator=generator)
        self.table = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
        used = 0
        for row, n in enumerate(needed):
            self.table[row, :n] = ids[used:used + n]
            used += n


def make_metadata(query_lens, seq_lens, tables, device="cpu"):
    """Metadata for sequences whose query rows are the last query_lens[i] of seq_lens[i] tokens (decodes first)."""
    num_decodes = sum(1 for n in query_lens if n == 1)
    assert all(n == 1 for n in query_lens[:num_decodes]), "decodes come first"
    slots = []
    bs = tables.block_size
    for row, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s_len - q_len, s_len):
            slots.append(int(tables.table[row, pos // bs]) * bs + pos % bs)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return AttentionMetadata(
        query_start_loc=starts.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_decodes=num_decodes,
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))


def make_case(query_lens, seq_lens, *, block_size=16, num_kv_heads=2, group=3, head_dim=80, dtype=torch.float32,
              seed=0, device="cpu"):
    """Random q, fully random K/V caches and the metadata of one step."""
    gen = torch.Generator().manual_seed(seed)
    tables = BlockTables(seq_lens, block_size, gen)
    shape = (tables.num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    return q, k_cache, v_cache, make_metadata(query_lens, seq_lens, tables, device)


def quantized(cache):
    """An int8 copy of a [N, bs, H, D] cache and its [N, bs, H] scales, by the reference's rule."""
    from batchgen_kernels import reference
    values, scales = reference.quantize_kv(cache.view(-1, *cache.shape[2:]))
    return values.view(cache.shape), scales.view(cache.shape[:3])


def int8_case(query_lens, seq_lens, dtype=torch.bfloat16, **kwargs):
    """make_case's step over an int8 cache: q, the int8 K and V caches, their (K, V) scales, the metadata, and the
    unquantized caches they came from."""
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, dtype=dtype, **kwargs)
    (k8, ks), (v8, vs) = quantized(k_cache), quantized(v_cache)
    return q, k8, v8, (ks, vs), md, (k_cache, v_cache)


def assert_close(actual, expected):
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


# Windows: smaller than a 16-token block, between the kernels' tiles (not a multiple of the blocks), above the tiles.
WINDOWS = (7, 40, 100)


def window_decode_lens(window):
    """Decode contexts shorter than, equal to, just past, and far longer than the window."""
    return [1, window - 1, window, window + 1, 3 * window + 5, 40 * window]


def window_prefill_lens(window):
    """(query_lens, seq_lens) of prefills around the window: a whole prompt within it, one a few windows long, a chunk
    across the window's edge (its first rows see key 0, its later ones do not), a chunk after a cached prefix longer
    than the window, a chunk longer than the window."""
    return ([window // 2 + 2, 2 * window + 7, 20, 40, window + 33],
            [window // 2 + 2, 2 * window + 7, window + 15, 3 * window + 42, window + 43])


def poison_unused_slots(cache, md, window=None):
    """A copy of `cache` with NaN in every slot no query of the step may see: past each sequence's end inside its last
    block, in blocks nobody owns, and under a sliding window before its first query's window. A kernel that reads
    them (even with a zero weight) returns NaN."""
    block_size = cache.shape[1]
    used = torch.zeros(cache.shape[0] * block_size, dtype=torch.bool)
    for row, (q_len, length) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        first = 0 if window is None else max(length - q_len - window + 1, 0)
        positions = torch.arange(first, length)
        table = md.block_tables[row].cpu()
        used[table[positions // block_size].long() * block_size + positions % block_size] = True
    poisoned = cache.clone()
    poisoned.view(-1, *cache.shape[2:])[~used.to(cache.device)] = float("nan")
    return poisoned


def forget_blocks_before_windows(md, window, block_size):
    """md with the block-table entries of blocks wholly before each sequence's first window set to -1 (an engine may
    free them): a kernel that looks them up reads out of bounds or refuses the table."""
    table = md.block_tables.clone()
    for row, (q_len, length) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        table[row, :max(length - q_len - window + 1, 0) // block_size] = -1
    return AttentionMetadata(**{**md.__dict__, "block_tables": table})
