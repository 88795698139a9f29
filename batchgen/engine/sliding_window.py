"""The local KV group: a model with sliding-window (local) layers beside global ones keeps the local layers' K/V in
a pool of its own, from which a sequence holds only the blocks its window still reaches.

A query at position p of a layer with window w reads keys p - w + 1 .. p, and every kernel starts its key loop
there. So once a sequence has computed c tokens (its next query sits at c), its local blocks wholly before
c - w + 1 are never read again: they go back to the pool, keeping their hash (findable by the prefix cache until
evicted, like any freed block), and the sequence's local block table holds the pool's null block (block 0, never
handed out) in their place, so that block i still covers positions i x block_size onwards.

A prefix-cache hit of L blocks lets the sequence compute from position L x block_size, whose window reaches back
w - 1 keys: the global group needs all L blocks, the local group only the last ceil((w - 1) / block_size) of
them. `LocalBlocks.longest_hit` finds the longest such L within the global group's hit.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from .block_pool import BlockPool, KVBlock
from .sequence import BlockIds, Sequence


@dataclass(frozen=True)
class KVLayout:
    """Which layers keep their K/V in the local group (the others: in the global group). One group (no local
    layers) when a model's layers are all of one kind."""

    num_layers: int
    local_layers: tuple[int, ...] = ()
    window: int | None = None  # the local group's window: its layers' largest

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.local_layers)


def kv_layout(windows: Seq[int | None]) -> KVLayout:
    """The KV groups of a model whose layer i has sliding window windows[i] (None: full attention)."""
    local = tuple(i for i, window in enumerate(windows) if window is not None)
    if not local or len(local) == len(windows):
        return KVLayout(len(windows))
    return KVLayout(len(windows), local, max(windows[i] for i in local))


@dataclass(frozen=True)
class LocalLayers:
    """What sizing the pools needs of a local group."""

    bytes_per_token: int  # K and V of its layers
    window: int


def hit_blocks(window: int, block_size: int) -> int:
    """Local blocks a cache hit needs: those holding the w - 1 keys before a position on a block boundary."""
    return -(-(window - 1) // block_size)


def local_blocks_at_most(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The local pool's size when the budget allows it: what max_num_seqs running sequences can hold at once (each
    its window's blocks, the block its next token goes in and one a prefill chunk may start in; a step's new
    tokens besides), a step's tokens of room again, so that even at that peak the windows sequences leave behind
    stay findable by the prefix cache for a step's allocations, and the null block."""
    step_blocks = -(-max_num_batched_tokens // block_size)
    return max_num_seqs * (hit_blocks(window, block_size) + 2) + 2 * step_blocks + 1


class LocalBlocks:
    """The local group's pool and each sequence's `local_blocks` / `local_block_ids` (one entry per global block,
    the null block where the window has left). KVCacheManager drives it beside the global pool."""

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null=True)
        self.null: KVBlock = self.pool.null_block
        self.block_size = block_size
        self.window = window
        self.hit_blocks = hit_blocks(window, block_size)

    def drop_skipped(self, seq: Sequence) -> None:
        """Give back the blocks wholly before the window of the sequence's next query (position
        num_computed_tokens), oldest first: the free queue evicts those first."""
        end = max(seq.num_computed_tokens - self.window + 1, 0) // self.block_size
        blocks, dropped = seq.local_blocks, []
        for i in range(end - 1, -1, -1):  # back to the last block dropped before
            if blocks[i] is self.null:
                break
            dropped.append(blocks[i])
            blocks[i] = self.null
        if dropped:
            dropped.reverse()
            self.pool.free_blocks(dropped)
            seq.local_block_ids.fill(end - len(dropped), end, self.null)

    def longest_hit(self, hashes: list[bytes], max_blocks: int) -> tuple[int, list[KVBlock]]:
        """The longest hit of at most `max_blocks` blocks (the global group's hit) whose last `hit_blocks` local
        blocks are cached, and the local table of its blocks (the null block before those)."""
        cached = self.pool.get_cached_block
        if self.hit_blocks == 0:  # a window of 1: a query sees only itself
            return max_blocks, [self.null] * max_blocks
        run = 0  # cached blocks from i on
        for i in range(max_blocks - 1, -1, -1):
            if cached(hashes[i]) is None:
                run = 0
                continue
            run += 1
            if run == self.hit_blocks:
                return i + run, [self.null] * i + [cached(h) for h in hashes[i:i + run]]
        return run, [cached(h) for h in hashes[:run]]  # shorter than the window: every block from 0 is needed

    def own(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """The blocks of a table that are the pool's to count: all but the null block."""
        return [block for block in blocks if block is not self.null]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.pool.touch(self.own(parent.local_blocks))
        child.local_blocks = list(parent.local_blocks)
        child.local_block_ids = parent.local_block_ids.copy()

    def free(self, seq: Sequence) -> None:
        """Release a sequence's local blocks tail first, as the global ones."""
        self.pool.free_blocks(self.own(reversed(seq.local_blocks)))
        seq.local_blocks.clear()
        if seq.local_block_ids is not None:
            seq.local_block_ids.clear()

    def ids(self, seq: Sequence) -> BlockIds:
        if seq.local_block_ids is None:
            seq.local_block_ids = BlockIds()
        return seq.local_block_ids
