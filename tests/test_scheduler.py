"""The scheduler's rule on its own: no model, the steps driven through schedule() and update_from_output()."""
import random

import pytest

from batchgen.engine.kv_cache_manager import KVCacheManager
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Sequence, SequenceStatus
from batchgen.engine.step_output import StepOutput


def make_seq(n, rid, max_tokens=100):
    return Sequence.from_request(Request(rid, list(range(rid * 1000, rid * 1000 + n)),
                                         SamplingParams(max_tokens=max_tokens)), seed=0)


def run_step(sched, token=7):
    """One step as the engine takes it: schedule, then report token `token` for every sequence that reached its
    end; a sequence stops once it has its max_tokens."""
    out = sched.schedule()
    sampled = [seq for seq, n in out.num_scheduled_tokens.items() if seq.num_computed_tokens + n == seq.num_tokens]
    finished = sched.update_from_output(
        out, StepOutput(sampled, [token] * len(sampled)),
        lambda seq, _: "length" if seq.num_output_tokens >= seq.params.max_tokens else None)
    out.sampled = sampled
    return out, finished


def scheduler(num_blocks=100, block_size=4, max_num_seqs=8, max_num_batched_tokens=100, caching=True):
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, max_num_batched_tokens)


def test_budget_chunks_prefill_and_mixes_decodes():
    sched = scheduler(max_num_batched_tokens=10)
    a, b = make_seq(6, 1), make_seq(30, 2)
    sched.add(a)
    sched.add(b)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {a: 6, b: 4}  # a whole, b a chunk with what is left of the budget
    assert a.num_tokens == 7 and b.num_tokens == 30  # only a reached its end and sampled
    out, _ = run_step(sched)  # a decodes first, b's prefill continues with the rest of the budget
    assert list(out.num_scheduled_tokens.items()) == [(a, 1), (b, 9)]
    assert out.stats().num_decodes == 1 and out.stats().num_prefill_tokens == 9
    assert b.num_computed_tokens == 13


def test_a_long_prefill_never_takes_the_decodes_budget_first():
    sched = scheduler(max_num_batched_tokens=8)
    decoders = [make_seq(3, i) for i in range(1, 4)]
    for seq in decoders:
        sched.add(seq)
    run_step(sched)  # 3 x 3 prompt tokens: a budget of 8 leaves the third one a token short
    run_step(sched)
    long = make_seq(40, 9)
    sched.add(long)
    for _ in range(5):
        out, _ = run_step(sched)
        scheduled = list(out.num_scheduled_tokens.items())
        assert scheduled[:3] == [(seq, 1) for seq in decoders]  # every decode, in admission order
        assert scheduled[3:] == [(long, 5)]  # the chunk gets what they leave


def test_max_num_seqs_limits_admission():
    sched = scheduler(max_num_seqs=2, max_num_batched_tokens=1000)
    seqs = [make_seq(3, i) for i in range(1, 5)]
    for s in seqs:
        sched.add(s)
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens) == seqs[:2]
    assert list(sched.waiting) == seqs[2:]


def test_finished_sequences_free_their_blocks_and_make_room():
    sched = scheduler(max_num_seqs=1)
    a, b = make_seq(5, 1, max_tokens=2), make_seq(5, 2, max_tokens=2)
    sched.add(a)
    sched.add(b)
    free_before = sched.kv_cache_manager.num_free_blocks
    _, finished = run_step(sched)
    assert finished == [] and a.status is SequenceStatus.RUNNING
    out, finished = run_step(sched)
    assert finished == [a] and a.status is SequenceStatus.FINISHED and a.finish_reason == "length"
    assert a.blocks == [] and a.output_token_ids == [7, 7]
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens) == [b]
    assert sched.kv_cache_manager.num_free_blocks == free_before - 2  # b's 6 tokens in 2 blocks


def test_preemption_takes_the_latest_admitted_and_requeues_it_first():
    # 4 blocks of 4 tokens: two sequences of 7 tokens take 2 blocks each; their 9th tokens need a third block each.
    sched = scheduler(num_blocks=4, caching=False)
    a, b = make_seq(7, 1), make_seq(7, 2)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled, each now has 8 tokens (7 computed)
    run_step(sched)  # decode: the 8th token fits in block 2 for both
    out, _ = run_step(sched)  # the 9th needs a new block each: only b (admitted last) is preempted
    assert out.preempted == [b] and out.stats().num_preempted == 1
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.blocks == []
    assert sched.waiting[0] is b and b.num_preemptions == 1 and sched.num_preemptions == 1
    assert out.num_scheduled_tokens == {a: 1}
    assert b.output_token_ids == [7, 7]  # nothing it generated is lost


def test_no_admission_in_a_step_that_preempted():
    # 3 blocks of 4 tokens, 2 tokens a step. When b's 5th token needs a block that a took, b is preempted; the
    # block it frees would take a 1-token chunk of b right back, only to preempt it again: a step that preempted
    # admits nothing.
    sched = scheduler(num_blocks=3, max_num_batched_tokens=2, caching=False)
    a, b = make_seq(3, 1), make_seq(1, 2)
    sched.add(a)
    sched.add(b)
    for _ in range(5):
        out, _ = run_step(sched)
        assert not out.preempted
    assert (a.num_tokens, b.num_tokens, sched.kv_cache_manager.num_free_blocks) == (7, 5, 0)
    out, _ = run_step(sched)
    assert out.preempted == [b] and out.num_scheduled_tokens == {a: 1}
    assert b.status is SequenceStatus.WAITING and sched.kv_cache_manager.num_free_blocks == 1
    sched.abort(a)  # room again: b comes back, its prompt and generated tokens recomputed
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {b: 2} and b.num_computed_tokens == 2


def test_a_budget_below_max_num_seqs_admits_only_what_it_can_decode():
    # max_num_batched_tokens 4 < max_num_seqs 8: were 8 sequences admitted, the last 4 would hold KV blocks through
    # every step without being scheduled. Only 4 run; each of them decodes every step.
    sched = scheduler(max_num_seqs=8, max_num_batched_tokens=4)
    seqs = [make_seq(1, i, max_tokens=50) for i in range(1, 9)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(10):
        out, _ = run_step(sched)
        assert list(out.num_scheduled_tokens) == seqs[:4]
        assert all(seq.blocks == [] for seq in seqs[4:])
    assert [seq.num_output_tokens for seq in seqs] == [10] * 4 + [0] * 4


@pytest.mark.parametrize("seed", range(6))
def test_no_running_sequence_starves(seed):
    """Random prompts and lengths, budgets below max_num_seqs, pools small enough to preempt: in every step that
    preempts nothing, every running sequence is scheduled, decodes come before the one prefill chunk, and the
    step stays within its budget. Every sequence finishes."""
    rng = random.Random(seed)
    budget = rng.choice([3, 5, 8, 16])
    sched = scheduler(num_blocks=rng.choice([12, 40]), max_num_seqs=budget * 2, max_num_batched_tokens=budget)
    seqs = [make_seq(rng.randint(1, 30), i, max_tokens=rng.randint(1, 12)) for i in range(1, 25)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        running_before = list(sched.running)
        out, _ = run_step(sched)
        scheduled = list(out.num_scheduled_tokens.items())
        assert sum(n for _, n in scheduled) <= budget and len(sched.running) <= budget
        if not out.preempted:
            assert all(seq in out.num_scheduled_tokens for seq in running_before)
        chunks = [seq for seq, _ in scheduled if seq not in out.sampled]  # prompt tokens still left after the step
        assert chunks in ([], [scheduled[-1][0]])
    assert all(seq.status is SequenceStatus.FINISHED for seq in seqs)


def test_abort_removes_waiting_and_running_sequences():
    sched = scheduler(max_num_seqs=1)
    a, b = make_seq(5, 1), make_seq(5, 2)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    free = sched.kv_cache_manager.num_free_blocks
    sched.abort(b)
    sched.abort(a)
    assert not sched.has_unfinished() and sched.kv_cache_manager.num_free_blocks == free + 2
    assert a.status is b.status is SequenceStatus.FINISHED


def test_prefix_hits_stop_before_the_positions_a_score_sequence_needs():
    """A SCORE sequence (a `choice` candidate) needs the logits of its positions from score_from on: a cache hit
    must not cover them, even when an identical sequence left them cached (a re-admission after a preemption)."""
    from batchgen.engine.sequence import SequenceRole

    manager = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    first = make_seq(14, 1)
    assert manager.allocate_slots(first, 14)  # caches its 3 full blocks: tokens 0-11
    manager.free(first)
    scored = make_seq(14, 1)
    scored.role, scored.score_from = SequenceRole.SCORE, 9
    hit = manager.get_computed_blocks(scored)
    assert hit.num_tokens == 8 and len(hit.blocks) == 2  # not the block holding positions 9-11
    plain = make_seq(14, 1)
    assert manager.get_computed_blocks(plain).num_tokens == 12
