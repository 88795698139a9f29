import random
import time
import tracemalloc

import pytest

from batchgen.engine.block_pool import BlockPool, hash_block
from batchgen.engine.kv_cache_manager import KVCacheManager
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.sequence import Sequence


def make_seq(ids, rid=0):
    return Sequence.from_request(Request(rid, list(ids), SamplingParams()), seed=0)


def test_hash_chain_depends_on_parent_and_tokens():
    a = hash_block(None, [1, 2, 3])
    assert a == hash_block(None, [1, 2, 3])
    assert a != hash_block(None, [1, 2, 4])
    assert hash_block(a, [5]) != hash_block(hash_block(None, [9, 9, 9]), [5])


def test_free_queue_lru_order_and_eviction():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert pool.num_free_blocks == 1
    for i, b in enumerate(blocks):
        pool.cache_block(b, hash_block(None, [i]))
    pool.free_blocks(list(reversed(blocks)))  # tail first
    assert pool.num_free_blocks == 4
    # The never-used block comes first, then the last block of the freed sequence.
    first, second = pool.get_new_blocks(2)
    assert first.block_id == 3 and second is blocks[2]
    assert pool.get_cached_block(hash_block(None, [2])) is None  # evicted on reuse
    assert pool.get_cached_block(hash_block(None, [0])) is blocks[0]  # still cached while free
    pool.touch([blocks[0]])  # a hit on a free block takes it out of the free queue
    assert pool.num_free_blocks == 1 and blocks[0].ref_count == 1


def test_prefix_hit_shares_blocks_and_caps_at_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = make_seq(range(12))  # exactly 3 full blocks
    hit = kv.get_computed_blocks(a)
    assert hit.num_tokens == 0
    assert kv.allocate_slots(a, 12, hit)
    assert len(a.blocks) == 3
    b = make_seq(list(range(12)) + [99, 98])
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 12 and hit.blocks == a.blocks and hit.local_blocks == []  # one group: no local table
    assert kv.allocate_slots(b, 2, hit)
    b.num_computed_tokens = 0
    assert [blk.ref_count for blk in a.blocks] == [2, 2, 2]
    # A prompt equal to a cached one still computes its last token: 2 of its 3 blocks hit.
    c = make_seq(range(12))
    assert kv.get_computed_blocks(c).num_tokens == 8
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 10


def test_allocation_refused_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(10))
    assert kv.allocate_slots(a, 10)
    b = make_seq(range(5))
    assert not kv.allocate_slots(b, 5)
    assert b.blocks == [] and kv.num_free_blocks == 0
    kv.free(a)
    assert kv.allocate_slots(b, 5) and kv.num_free_blocks == 1


class ReferencePool:
    """The pool's rule written plainly: a list of free block ids that starts in id order, freed blocks appended,
    new blocks taken from the front (a cached one losing its hash), cache hits taken out wherever they are."""

    def __init__(self, num_blocks):
        self.free = list(range(num_blocks))
        self.ref = [0] * num_blocks
        self.hash = [None] * num_blocks
        self.cached = {}

    def get_new_blocks(self, n):
        ids, self.free = self.free[:n], self.free[n:]
        for i in ids:
            if self.hash[i] is not None and self.cached.get(self.hash[i]) == i:
                del self.cached[self.hash[i]]
            self.hash[i], self.ref[i] = None, 1
        return ids

    def touch(self, ids):
        for i in ids:
            if self.ref[i] == 0:
                self.free.remove(i)
            self.ref[i] += 1

    def free_blocks(self, ids):
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                self.free.append(i)

    def cache_block(self, i, h):
        if self.hash[i] is None:
            self.hash[i] = h
            self.cached.setdefault(h, i)


def test_pool_follows_the_reference_rule_over_random_operations():
    """Blocks created on first use give exactly the order, evictions and cache hits of a queue that starts with
    every block in id order."""
    rng = random.Random(0)
    for _ in range(20):
        num_blocks = rng.randint(2, 40)
        pool, ref = BlockPool(num_blocks, enable_caching=True), ReferencePool(num_blocks)
        held = []  # lists of block ids held by "sequences"
        for _ in range(200):
            op = rng.random()
            if op < 0.4 and ref.free:
                n = rng.randint(1, len(ref.free))
                got = [b.block_id for b in pool.get_new_blocks(n)]
                assert got == ref.get_new_blocks(n)
                held.append(got)
            elif op < 0.6 and held:
                ids = held.pop(rng.randrange(len(held)))
                pool.free_blocks([pool.blocks[i] for i in reversed(ids)])
                ref.free_blocks(list(reversed(ids)))
            elif op < 0.8 and held:
                ids = rng.choice(held)
                for i in ids:
                    h = hash_block(None, [rng.randrange(8)])  # few keys: duplicates and collisions happen
                    pool.cache_block(pool.blocks[i], h)
                    ref.cache_block(i, h)
            else:
                hits = sorted({i for i in ref.cached.values()})[:rng.randint(0, 3)]
                pool.touch([pool.blocks[i] for i in hits])
                ref.touch(hits)
                if hits:
                    held.append(hits)
            assert pool.num_free_blocks == len(ref.free)
            assert {h: b.block_id for h, b in pool.cached.items()} == ref.cached
            assert [pool.blocks[i].ref_count for i in range(pool.num_touched)] == ref.ref[:pool.num_touched]
            assert all(r == 0 for r in ref.ref[pool.num_touched:])  # never handed out: not created
        with pytest.raises(RuntimeError, match="free"):
            pool.get_new_blocks(pool.num_free_blocks + 1)


def test_a_huge_pool_is_built_at_once_and_costs_no_memory():
    """A small model on a large GPU gets tens of millions of blocks: the pool must not build one object per block
    (that was ~1.6 s and ~112 MB per million)."""
    tracemalloc.start()
    started = time.perf_counter()
    kv = KVCacheManager(num_blocks=20_000_000, block_size=16, enable_prefix_caching=True)
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 2**20
    assert kv.num_free_blocks == 20_000_000 and kv.pool.num_touched == 0
    a = make_seq(range(40))
    assert kv.allocate_slots(a, 40)
    assert [b.block_id for b in a.blocks] == [0, 1, 2] and kv.num_free_blocks == 20_000_000 - 3
    assert kv.pool.num_touched == 3
