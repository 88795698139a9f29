"""One scheduling rule for everything: each step spends a token budget on running sequences first, then admits
waiting ones. Chunked prefill, prefix-cache hits and resumed preemptions are all just `num_computed_tokens`
catching up with `num_tokens`.

Two invariants follow from admitting only while budget is left, and only after every running sequence got its
share (the budget is spent front to back):
- only the most recently admitted sequence can still have prompt tokens left, and it sits at the tail of
  `running`; every other running sequence is decoding. So walking `running` in admission order schedules the
  decodes before the one prefill chunk. A preemption takes the tail, so this stays true.
- every admission costs at least one token of the step's budget, so no more sequences run than
  max_num_batched_tokens: each running sequence is scheduled in every step that preempts nothing, even when
  max_num_batched_tokens < max_num_seqs (which vLLM refuses). None holds KV blocks while it starves.
A request that fans out (n samples, `choice` candidates) bends both a little: its PREFIX sequence, once computed,
is replaced at the tail of `running` by its forks, which share its blocks and each still have a few tokens to
compute; its admission reserves room for them under max_num_seqs.
Its forks run in waves of at most max_num_seqs (`max_live_forks`) at a time, so a `choice` of thousands of labels
holds the blocks and step of max_num_seqs sequences, not of all its candidates: while forks are still to start,
the computed PREFIX is `held` (out of `running`, its blocks kept), and each fork that finishes starts the next one
at the tail of `running`. It lets go of its blocks once its last fork has started (the forks hold what they share).
Only when nothing else can give blocks back (the sequence that needs them is the last one running, or none runs)
does a held PREFIX give its blocks back: it is requeued behind the waiting sequences and starts its remaining forks
once recomputed (from the prefix cache, where its blocks are still there).
With speculative decoding (speculative/), a decoding sequence of a small enough step is given KV slots for a few
guessed tokens after its last one (`SchedulerOutput.lookaheads`); the guesses are computed with it, and those the
sampler confirms count as computed, the others' slots are written over by the next step (nothing is rolled back
but the count: blocks are cached only up to the tokens that are the sequence's own).
With LoRA adapters, a step holds at most `max_adapters` of them (the model's slots, lora/attach.py): a waiting
sequence whose adapter would be one too many is passed over, and admitted in order once a slot's adapter has no
running sequence left.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .sequence import Sequence, SequenceRole, SequenceStatus
from .step_output import StepOutput


@dataclass
class StepStats:
    """The shape of one scheduled step."""

    num_seqs: int
    num_decodes: int  # sequences adding one token after a fully computed context
    num_prefill_tokens: int  # every other scheduled token: prompts, prompt chunks, recomputation after preemption
    num_preempted: int
    num_draft_tokens: int = 0  # guessed tokens verified beside the decodes (speculative decoding)


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    # Decoding sequences given slots for this many guessed tokens after their last one (counted in
    # num_scheduled_tokens until set_drafts() says how many guesses there are)
    lookaheads: dict[Sequence, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.num_scheduled_tokens)

    def set_drafts(self, drafts: dict[Sequence, list[int]]) -> None:
        """The guesses of each sequence with a lookahead (at most that many): its tokens to compute this step
        become its last one and its guesses."""
        for seq, lookahead in self.lookaheads.items():
            seq.draft_token_ids = drafts.get(seq, [])[:lookahead]
            self.num_scheduled_tokens[seq] = 1 + len(seq.draft_token_ids)

    def stats(self) -> StepStats:
        decodes = sum(1 for seq, n in self.num_scheduled_tokens.items()
                      if n == 1 + len(seq.draft_token_ids) and seq.num_output_tokens > 0
                      and seq.num_computed_tokens + 1 == seq.num_tokens)
        drafts = sum(len(seq.draft_token_ids) for seq in self.lookaheads)
        tokens = sum(self.num_scheduled_tokens.values())
        return StepStats(len(self.num_scheduled_tokens), decodes, tokens - decodes - drafts, len(self.preempted),
                         drafts)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_adapters: int | None = None, speculator=None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.speculator = speculator  # a speculative.Speculator, or None
        self.max_adapters = max_adapters  # LoRA adapters in one step at most (the model's slots); None: no adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_live_forks = max_num_seqs  # a fanned-out request's forks running at once: one wave
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # computed PREFIX sequences keeping their blocks for forks still to start
        self.prefix_cache_queries = 0  # prompt tokens looked up at first admission
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # guesses verified (speculative decoding), and those the sampler confirmed
        self.num_accepted_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        guesses = self.speculator.guesses(len(self.running)) if self.speculator is not None else 0

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            lookahead = min(self.speculator.lookahead(seq), guesses, budget - num_new) if guesses else 0
            if lookahead and self.kv_cache_manager.allocate_slots(seq, num_new + lookahead):
                out.lookaheads[seq] = lookahead
                num_new += lookahead
            while seq not in out.lookaheads and not self.kv_cache_manager.allocate_slots(seq, num_new):
                if self.running[-1] is seq and self.held:  # else seq preempts itself, and could again and again
                    victim = self._release_held()
                else:
                    victim = self.running.pop()  # the most recently admitted gives its blocks back
                    self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            out.num_scheduled_tokens[seq] = num_new
            budget -= num_new
            index += 1

        if not out.preempted:  # blocks are short: admitting now would only preempt again
            adapters = self._adapters_in_use()
            position = 0  # the first waiting sequence not passed over for its adapter
            while position < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[position]
                if self.running and len(self.running) + self._seqs_when_running(seq) > self.max_num_seqs:
                    break
                name = seq.adapter.name
                if name is not None and name not in adapters and len(adapters) >= (self.max_adapters or 0):
                    position += 1  # its adapter would need a slot that the running adapters hold: it waits its turn
                    continue
                hit = self.kv_cache_manager.get_computed_blocks(seq)
                num_hit_tokens = hit.num_tokens
                num_new = min(seq.num_tokens - num_hit_tokens, budget)
                if not self.kv_cache_manager.allocate_slots(seq, num_new, hit):
                    if self.running or not self.held:
                        break
                    self._release_held()  # nothing runs: only a held PREFIX's blocks can make room
                    continue
                del self.waiting[position]
                if name is not None:
                    adapters.add(name)
                seq.num_computed_tokens = num_hit_tokens
                seq.status = SequenceStatus.RUNNING
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = num_hit_tokens
                    seq.first_scheduled_time = time.monotonic()
                    self.prefix_cache_queries += seq.num_prompt_tokens
                    self.prefix_cache_hits += num_hit_tokens
                self.running.append(seq)
                out.num_scheduled_tokens[seq] = num_new
                budget -= num_new
        return out

    def _adapters_in_use(self) -> set[str]:
        """The adapters of the running sequences and of held PREFIXes (whose forks start without admission)."""
        if self.max_adapters is None:
            return set()
        return {seq.adapter.name for seq in (*self.running, *self.held) if seq.adapter.name is not None}

    def _seqs_when_running(self, seq: Sequence) -> int:
        """Sequences `seq` occupies once computed: a PREFIX becomes its next wave of forks."""
        if seq.role is SequenceRole.PREFIX:
            return max(min(len(seq.forks), self.max_live_forks - seq.num_live_forks), 1)
        return 1

    def update_from_output(self, out: SchedulerOutput, step: StepOutput,
                           stop_reason: Callable[[Sequence, int], str | None]) -> list[Sequence]:
        """After the model ran `out`: computed tokens catch up, each sampled sequence gets its token (and its
        logprobs), SCORE sequences their scores, POOL ones what they pool; those that `stop_reason` stops, and
        those with nothing left to compute that sample nothing, finish and give back their blocks (which stay
        cached). A computed PREFIX starts its first wave of forks instead, each finished fork the next one. Returns
        the finished ones."""
        now = time.monotonic()
        for seq, first, values, tops in step.scores:
            seq.record_scores(first, values, tops)
        for seq, first, vector in step.pooled:
            seq.record_pooled(first, vector)
        finished = []
        for seq, n in out.num_scheduled_tokens.items():
            seq.num_computed_tokens += n - len(seq.draft_token_ids)  # guesses count once confirmed
            if not seq.samples and seq.num_computed_tokens == seq.num_tokens:
                if seq.role is SequenceRole.PREFIX:
                    self._hold(seq, now)
                else:
                    self._finish(seq, "computed", now, finished)
        previous = None
        for seq, token, logprobs in zip(step.sampled, step.tokens, step.logprobs or [None] * len(step.sampled)):
            if seq.status is SequenceStatus.FINISHED:  # stopped at an earlier token of its guesses
                continue
            if seq is previous:  # its next guess was confirmed: the token before this one was computed
                seq.num_computed_tokens += 1
                self.num_accepted_tokens += 1
            previous = seq
            seq.append_token(token)
            if logprobs is not None:
                seq.append_logprobs(*logprobs)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = stop_reason(seq, token)
            if reason:
                self._finish(seq, reason, now, finished)
        for seq in out.lookaheads:
            guessed, seq.draft_token_ids = len(seq.draft_token_ids), []
            self.num_draft_tokens += guessed
            if seq.status is SequenceStatus.RUNNING:  # blocks its confirmed guesses filled become findable
                self.kv_cache_manager.cache_full_blocks(seq, seq.num_computed_tokens,
                                                        max(seq.num_computed_tokens - guessed - 1, 0))
        return finished

    def _finish(self, seq: Sequence, reason: str, now: float, finished: list[Sequence]) -> None:
        seq.finish_reason, seq.finish_time = reason, now
        self._remove(seq)
        finished.append(seq)
        prefix = seq.parent
        if prefix is not None:
            prefix.num_live_forks -= 1
            if prefix.status is SequenceStatus.HELD:
                self._start_forks(prefix)

    def _hold(self, prefix: Sequence, now: float) -> None:
        """A computed PREFIX leaves `running`, keeping its blocks, and starts its forks."""
        self.running.remove(prefix)
        prefix.status = SequenceStatus.HELD
        prefix.finish_reason, prefix.finish_time = "computed", now
        self.held.append(prefix)
        self._start_forks(prefix)

    def _start_forks(self, prefix: Sequence) -> None:
        """Start forks of a held PREFIX up to a wave: they share its blocks and run from its last token on. Once
        the last has started, the PREFIX finishes and lets go of its blocks."""
        while prefix.forks and prefix.num_live_forks < self.max_live_forks:
            child = prefix.forks.popleft()
            self.kv_cache_manager.fork(prefix, child)
            child.parent = prefix
            child.num_cached_tokens = prefix.num_cached_tokens
            child.first_scheduled_time = prefix.first_scheduled_time
            child.num_preemptions = prefix.num_preemptions
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            prefix.num_live_forks += 1
        if not prefix.forks:
            self._remove(prefix)

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished sequence, waiting, running or held; its blocks go back. Starts no fork."""
        self._remove(seq)

    def _remove(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.HELD:
            self.held.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _release_held(self) -> Sequence:
        """The most recently held PREFIX gives its blocks back and waits behind everything else (its forks that
        wait come first); recomputed, it starts the rest of its forks."""
        prefix = self.held.pop()
        self._preempt(prefix, requeue_first=False)
        return prefix

    def _preempt(self, seq: Sequence, requeue_first: bool = True) -> None:
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_draft_computed = 0  # its blocks (and a draft model's KV in them) are gone
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if requeue_first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
