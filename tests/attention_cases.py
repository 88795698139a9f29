"""Random attention cases shared by the kernel tests (Triton and C++ CPU) and their oracle comparison.

Every cache is filled with random values everywhere, and block tables are shuffled, so a kernel that reads a wrong
slot, block or position gets different numbers, not zeros that happen to match.
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


def assert_close(actual, expected):
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])
