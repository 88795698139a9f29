"""Per-request KV block bookkeeping on top of the BlockPool: prefix-cache lookups, slot allocation, freeing."""
from __future__ import annotations

from .block_pool import BlockPool, KVBlock
from .sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a not-yet-admitted sequence, as (blocks, tokens). The last token is always
        left to compute, since its logits are needed."""
        if not self.enable_prefix_caching:
            return [], 0
        hits = []
        for block_hash in seq.full_block_hashes(self.block_size, seq.num_tokens - 1):
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
        # Free cache hits sit in the free queue: adopting them takes them out of it.
        num_free_hits = sum(1 for block in computed_blocks if block.ref_count == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return False
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

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks tail first, so the shared head of a prefix stays cached longest."""
        self.pool.free_blocks(list(reversed(seq.blocks)))
        seq.blocks.clear()
        seq.block_ids.clear()
