from batchgen.engine.kv_cache_manager import KVCacheManager
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Sequence, SequenceStatus


def make_seq(n, rid):
    return Sequence.from_request(Request(rid, list(range(rid * 1000, rid * 1000 + n)), SamplingParams()), seed=0)


def advance(out):
    """What the engine does after a step: computed tokens catch up; sequences that reached the end get a token."""
    for seq, n in out.num_scheduled_tokens.items():
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def test_budget_chunks_prefill_and_mixes_decodes():
    sched = Scheduler(KVCacheManager(100, 4, True), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_seq(6, 1), make_seq(30, 2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {a: 6, b: 4}
    advance(out)
    out = sched.schedule()  # a decodes, b continues its prefill in the same step
    assert out.num_scheduled_tokens == {a: 1, b: 9}
    advance(out)
    assert b.num_computed_tokens == 13


def test_max_num_seqs_limits_admission():
    sched = Scheduler(KVCacheManager(100, 4, True), max_num_seqs=2, max_num_batched_tokens=1000)
    seqs = [make_seq(3, i) for i in range(1, 5)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == seqs[:2]
    assert len(sched.waiting) == 2


def test_preemption_frees_latest_and_requeues_it_first():
    # 4 blocks of 4 tokens: two sequences of 7 tokens take 2 blocks each; the next decode needs a third block.
    sched = Scheduler(KVCacheManager(4, 4, False), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(7, 1), make_seq(7, 2)
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())  # both prefilled, each now has 8 tokens (7 computed)
    out = sched.schedule()  # decode: 8th token fits in block 2 for both
    advance(out)
    out = sched.schedule()  # 9th token needs a new block each: only b is preempted
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.blocks == []
    assert sched.waiting[0] is b and b.num_preemptions == 1
    assert out.num_scheduled_tokens == {a: 1}
    advance(out)
    sched.finish(a)
    out = sched.schedule()  # b comes back with prompt + generated tokens
    assert out.num_scheduled_tokens == {b: b.num_tokens}
    assert b.num_tokens == 9
