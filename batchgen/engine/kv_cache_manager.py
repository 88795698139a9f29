"""Per-request KV block bookkeeping on top of the BlockPool: prefix-cache lookups, slot allocation, forks, freeing.

A model with sliding-window layers beside global ones has two KV groups, each with its own pool: the global one
(`pool`, a sequence's `blocks`) and the local one (`local`, sliding_window.py: a sequence's `local_blocks`, of which
it keeps only those its window still reaches). Both grow together, block for block; a sequence is admitted or
given its next blocks only when both pools have them. A model without local layers has the global group alone.

A fork shares all of a sequence's blocks by reference count. Full blocks are never written again, so sharing them
is free; a shared block that is only partly filled is copied the first time a sharer writes into it (copy on
write): the copy is queued in `pending_copies` (`pending_local_copies`) for the model runner to make before the
step's forward pass."""
from __future__ import annotations

from typing import NamedTuple

from .block_pool import BlockPool, KVBlock
from .kv_pool import LocalPoolSize
from .sequence import BlockIds, Sequence
from .sliding_window import LocalBlocks


class CacheHit(NamedTuple):
    """A cached prefix of `num_tokens` tokens: its global blocks and, with a local group, its local table."""

    blocks: list[KVBlock]
    local_blocks: list[KVBlock]
    num_tokens: int


NO_HIT = CacheHit([], [], 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 local: LocalPoolSize | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.local = None if local is None else LocalBlocks(local.num_blocks, block_size, local.window,
                                                             enable_prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []  # (source block id, destination block id)
        self.pending_local_copies: list[tuple[int, int]] = []  # the same, in the local pool

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_touched(self) -> tuple[int, int]:
        """One past the highest block id ever handed out, in the global pool and in the local one (0 without)."""
        return self.pool.num_touched, 0 if self.local is None else self.local.pool.num_touched

    def get_computed_blocks(self, seq: Sequence) -> CacheHit:
        """The longest cached prefix of a not-yet-admitted sequence. The tokens whose logits are needed are always
        left to compute: the last one, and a SCORE sequence's scored ones. With a local group, the longest prefix
        whose last window of local blocks is still cached too."""
        if not self.enable_prefix_caching:
            return NO_HIT
        hits = []
        hashes = seq.full_block_hashes(self.block_size, seq.num_cacheable_tokens)
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.local is None:
            return CacheHit(hits, [], len(hits) * self.block_size)
        num_blocks, local_hits = self.local.longest_hit(hashes, len(hits))
        return CacheHit(hits[:num_blocks], local_hits, num_blocks * self.block_size)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hit: CacheHit = NO_HIT) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens after its computed ones (and after the prefix hit
        `hit`, whose blocks it adopts), in every group. Returns False, changing nothing but dropping local blocks
        that left the window, when a pool is short."""
        bs, local = self.block_size, self.local
        num_computed = seq.num_computed_tokens + hit.num_tokens
        num_new_blocks = -(-(num_computed + num_new_tokens) // bs) - len(seq.blocks) - len(hit.blocks)
        # Writing into a partly filled block that a fork shares: this sequence needs its own copy.
        partial = num_computed // bs if num_new_tokens > 0 and num_computed % bs != 0 else -1
        copy_last = partial >= 0 and seq.blocks[partial].ref_count > 1
        if num_new_blocks + copy_last > self.pool.num_free_blocks - _free_hits(hit.blocks):
            return False
        if local is not None:
            local.drop_skipped(seq)
            local_hits = local.own(hit.local_blocks)
            copy_local = partial >= 0 and seq.local_blocks[partial].ref_count > 1
            if num_new_blocks + copy_local > local.pool.num_free_blocks - _free_hits(local_hits):
                return False
        _grow(self.pool, seq.blocks, seq.block_ids, hit.blocks, hit.blocks, num_new_blocks,
              partial if copy_last else -1, self.pending_copies)
        if local is not None:
            _grow(local.pool, seq.local_blocks, local.ids(seq), hit.local_blocks, local_hits, num_new_blocks,
                  partial if copy_local else -1, self.pending_local_copies)
        # Blocks that this step fills become findable now: within a step every layer stores all new K/V before
        # any attention reads them, so a sequence scheduled alongside may already share them. Slots for guessed
        # tokens (speculative decoding) are not the sequence's own tokens: cached once confirmed.
        self.cache_full_blocks(seq, min(num_computed + num_new_tokens, seq.num_tokens), num_computed)
        return True

    def cache_full_blocks(self, seq: Sequence, num_tokens: int, num_cached_before: int | None = None) -> None:
        """Make the full blocks of `seq`'s first `num_tokens` tokens findable by the prefix cache; only blocks from
        the one holding token `num_cached_before` on can newly fill up (default: all of them)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first = 0 if num_cached_before is None else num_cached_before // bs
        hashes = seq.full_block_hashes(bs, num_tokens)
        for block, block_hash in zip(seq.blocks[first:len(hashes)], hashes[first:]):
            self.pool.cache_block(block, block_hash)
        if self.local is not None:
            for block, block_hash in zip(seq.local_blocks[first:len(hashes)], hashes[first:]):
                self.local.pool.cache_block(block, block_hash)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` takes a reference on every block of `parent` and continues from its computed tokens."""
        self.pool.touch(parent.blocks)
        child.blocks = list(parent.blocks)
        child.block_ids = parent.block_ids.copy()
        if self.local is not None:
            self.local.fork(parent, child)
        child.block_hashes = list(parent.block_hashes)  # its tokens extend the parent's
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies on write queued since the last call: (global ones, local ones)."""
        copies, local_copies = self.pending_copies, self.pending_local_copies
        self.pending_copies, self.pending_local_copies = [], []
        return copies, local_copies

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks tail first, so the shared head of a prefix stays cached longest."""
        self.pool.free_blocks(list(reversed(seq.blocks)))
        seq.blocks.clear()
        seq.block_ids.clear()
        if self.local is not None:
            self.local.free(seq)


def _free_hits(hits: list[KVBlock]) -> int:
    """Free cache hits sit in the free queue: adopting them takes them out of it."""
    return sum(1 for block in hits if block.ref_count == 0)


def _grow(pool: BlockPool, blocks: list[KVBlock], ids: BlockIds, table: list[KVBlock], hits: list[KVBlock],
          num_new: int, copy_at: int, copies: list[tuple[int, int]]) -> None:
    """One group's side of allocate_slots, once it is known to fit: copy the shared block at `copy_at` (-1: none),
    adopt a hit's `table` (taking a reference on its `hits`), then append `num_new` new blocks."""
    if copy_at >= 0:  # the last block: a sequence writes only at its end
        shared = blocks[copy_at]
        (own,) = pool.get_new_blocks(1)
        copies.append((shared.block_id, own.block_id))
        pool.free_blocks([shared])
        blocks[copy_at] = own
        ids.replace(copy_at, own)
    pool.touch(list(hits))
    new_blocks = list(table)
    if num_new > 0:
        new_blocks += pool.get_new_blocks(num_new)
    if new_blocks:
        blocks.extend(new_blocks)
        ids.extend(new_blocks)
