"""Fixed-size KV blocks: reference counts, the prefix-cache hash map and an LRU queue of free blocks.

A freed block keeps its hash and stays findable until it is handed out again, so the free queue doubles as the
prefix cache's eviction order: blocks are taken from the head, freed blocks join the tail.

Never-used blocks come before every freed one, lowest id first, and their KVBlock objects are created only then: a
pool of millions of blocks (a large GPU) costs nothing until its blocks are used. So the blocks ever handed out are
always ids [0, num_touched): the model runner zeroes that range as it grows, and the CPU cache's pages beyond it are
never written (not resident).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Key of a full block: chained over the parent's key, so equal keys mean equal prefixes."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves: O(1) pop, append and removal from the middle
    (a cache hit on a free block takes it out of the queue wherever it is)."""

    def __init__(self) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.size = 0

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.size += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        if self.size == 0:
            raise RuntimeError("no free KV blocks")
        block = self._head.next_free
        self.remove(block)
        return block


class BlockPool:
    """`reserve_null`: block 0 is the null block, handed out to no sequence and never freed: the placeholder a
    sliding-window group's block tables hold where blocks left the window (the kernels never read it)."""

    def __init__(self, num_blocks: int, enable_caching: bool, reserve_null: bool = False) -> None:
        self.num_blocks = num_blocks
        self.usable_blocks = num_blocks - reserve_null  # all but the null block
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = []  # block i at index i, created when first handed out
        self.free_queue = FreeBlockQueue()  # blocks freed since, behind the never-used ones
        self.cached: dict[bytes, KVBlock] = {}
        self.peak_in_use = 0  # the most blocks held by sequences at once
        self.null_block = self.get_new_blocks(1)[0] if reserve_null else None

    @property
    def num_touched(self) -> int:
        """One past the highest block id ever handed out."""
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.blocks) + self.free_queue.size

    @property
    def num_in_use(self) -> int:
        """Blocks held by sequences now (the null block is none of them)."""
        return self.usable_blocks - self.num_free_blocks

    def _note_use(self) -> None:
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        num_free = self.num_free_blocks
        if n > num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {num_free} free")
        blocks = []
        for _ in range(n):
            if len(self.blocks) < self.num_blocks:  # never-used blocks go first, created now
                block = KVBlock(len(self.blocks))
                self.blocks.append(block)
            else:
                block = self.free_queue.popleft()
                if block.block_hash is not None:  # evict the least recently freed cached block
                    if self.cached.get(block.block_hash) is block:
                        del self.cached[block.block_hash]
                    block.block_hash = None
            block.ref_count = 1
            blocks.append(block)
        self.peak_in_use = max(self.peak_in_use, self.usable_blocks - num_free + n)  # _note_use, inlined: hot
        return blocks

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
        self._note_use()

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue in the order given."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)
