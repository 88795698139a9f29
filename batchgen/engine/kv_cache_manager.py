"""Per-request KV block bookkeeping on top of the BlockPool: prefix-cache lookups, slot allocation, forks, freeing.

A fork shares all of a sequence's blocks by reference count. Full blocks are never written again, so sharing them
is free; a shared block that is only partly filled is copied the first time a sharer writes into it (copy on
write): the copy is queued in `pending_copies` for the model runner to make before the step's forward pass."""
from __future__ import annotations

from .block_pool import BlockPool, KVBlock
from .sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []  # (source block id, destination block id)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a not-yet-admitted sequence, as (blocks, tokens). The tokens whose logits
        are needed are always left to compute: the last one, and a SCORE sequence's scored ones."""
        if not self.enable_prefix_caching:
            return [], 0
        hits = []
        for block_hash in seq.full_block_hashes(self.block_size, seq.num_cacheable_tokens):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[KVBlock] = ()) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens after its computed ones (and after the prefix hits in
        `computed_blocks`, which it adopts). Returns False, changing nothing, when the pool is short."""
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(seq.blocks) - len(computed_blocks)
        # Writing into a partly filled block that a fork shares: this sequence needs its own copy.
        copy_last = (num_new_tokens > 0 and num_computed % self.block_size != 0
                     and seq.blocks[num_computed // self.block_size].ref_count > 1)
        # Free cache hits sit in the free queue: adopting them takes them out of it.
        num_free_hits = sum(1 for block in computed_blocks if block.ref_count == 0)
        if num_new_blocks + copy_last > self.pool.num_free_blocks - num_free_hits:
            return False
        if copy_last:
            self._copy_on_write(seq, num_computed // self.block_size)
        self.pool.touch(list(computed_blocks))
        new_blocks = list(computed_blocks)
        if num_new_blocks > 0:
            new_blocks += self.pool.get_new_blocks(num_new_blocks)
        if new_blocks:
            seq.blocks.extend(new_blocks)
            seq.block_ids.extend(new_blocks)
        if self.enable_prefix_caching:
            # Blocks that this step fills become findable now: within a step every layer stores all new K/V before
            # any attention reads them, so a sequence scheduled alongside may already share them.
            # Only blocks from the first one this step writes to can newly fill up.
            first = num_computed // self.block_size
            hashes = seq.full_block_hashes(self.block_size, num_computed + num_new_tokens)
            for block, block_hash in zip(seq.blocks[first:len(hashes)], hashes[first:]):
                self.pool.cache_block(block, block_hash)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` takes a reference on every block of `parent` and continues from its computed tokens."""
        self.pool.touch(parent.blocks)
        child.blocks = list(parent.blocks)
        child.block_ids = parent.block_ids.copy()
        child.block_hashes = list(parent.block_hashes)  # its tokens extend the parent's
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        shared = seq.blocks[index]  # the last block: a sequence writes only at its end
        (own,) = self.pool.get_new_blocks(1)
        self.pending_copies.append((shared.block_id, own.block_id))
        self.pool.free_blocks([shared])
        seq.blocks[index] = own
        seq.block_ids.replace_last(own)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks tail first, so the shared head of a prefix stays cached longest."""
        self.pool.free_blocks(list(reversed(seq.blocks)))
        seq.blocks.clear()
        seq.block_ids.clear()
