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
compute; its admission reserves room for all of them under max_num_seqs.
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


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.num_scheduled_tokens)

    def stats(self) -> StepStats:
        decodes = sum(1 for seq, n in self.num_scheduled_tokens.items()
                      if n == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens + 1 == seq.num_tokens)
        tokens = sum(self.num_scheduled_tokens.values())
        return StepStats(len(self.num_scheduled_tokens), decodes, tokens - decodes, len(self.preempted))


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_cache_queries = 0  # prompt tokens looked up at first admission
        self.prefix_cache_hits = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv_cache_manager.allocate_slots(seq, num_new):
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
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if self.running and len(self.running) + seq.num_seqs_when_running > self.max_num_seqs:
                    break
                hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - num_hit_tokens, budget)
                if not self.kv_cache_manager.allocate_slots(seq, num_new, hits):
                    break
                self.waiting.popleft()
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

    def update_from_output(self, out: SchedulerOutput, step: StepOutput,
                           stop_reason: Callable[[Sequence, int], str | None]) -> list[Sequence]:
        """After the model ran `out`: computed tokens catch up, each sampled sequence gets its token (and its
        logprobs), SCORE sequences their scores; those that `stop_reason` stops, and those with nothing left to
        compute that sample nothing, finish and give back their blocks (which stay cached). A PREFIX sequence
        first hands its blocks to its forks. Returns the finished ones."""
        now = time.monotonic()
        for seq, first, values, tops in step.scores:
            seq.record_scores(first, values, tops)
        finished = []
        for seq, n in out.num_scheduled_tokens.items():
            seq.num_computed_tokens += n
            if not seq.samples and seq.num_computed_tokens == seq.num_tokens:
                if seq.role is SequenceRole.PREFIX:
                    self._start_forks(seq)
                seq.finish_reason, seq.finish_time = "computed", now
                self._remove(seq)
                finished.append(seq)
        for seq, token, logprobs in zip(step.sampled, step.tokens, step.logprobs or [None] * len(step.sampled)):
            seq.append_token(token)
            if logprobs is not None:
                seq.append_logprobs(*logprobs)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = stop_reason(seq, token)
            if reason:
                seq.finish_reason, seq.finish_time = reason, now
                self._remove(seq)
                finished.append(seq)
        return finished

    def _start_forks(self, prefix: Sequence) -> None:
        """The forks of a computed PREFIX share its blocks and run from its last token on."""
        for child in prefix.forks:
            self.kv_cache_manager.fork(prefix, child)
            child.num_cached_tokens = prefix.num_cached_tokens
            child.first_scheduled_time = prefix.first_scheduled_time
            child.num_preemptions = prefix.num_preemptions
            child.status = SequenceStatus.RUNNING
            self.running.append(child)

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished sequence, waiting or running; its blocks go back."""
        self._remove(seq)

    def _remove(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
