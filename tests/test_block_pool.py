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
    hits, n = kv.get_computed_blocks(a)
    assert n == 0
    assert kv.allocate_slots(a, 12, hits)
    assert len(a.blocks) == 3
    b = make_seq(list(range(12)) + [99, 98])
    hits, n = kv.get_computed_blocks(b)
    assert n == 12 and hits == a.blocks
    assert kv.allocate_slots(b, 2, hits)
    b.num_computed_tokens = 0
    assert [blk.ref_count for blk in a.blocks] == [2, 2, 2]
    # A prompt equal to a cached one still computes its last token: 2 of its 3 blocks hit.
    c = make_seq(range(12))
    hits, n = kv.get_computed_blocks(c)
    assert n == 8
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
