"""One scheduling rule for everything: each step spends a token budget on running sequences first (decodes, then
unfinished prefill chunks), then admits waiting ones. Chunked prefill, prefix-cache hits and resumed preemptions are
all just `num_computed_tokens` catching up with `num_tokens`."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def __bool__(self) -> bool:
        return bool(self.num_scheduled_tokens)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv_cache = kv_cache
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
            while not self.kv_cache.allocate_slots(seq, num_new):
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

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                hits, num_hit_tokens = self.kv_cache.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - num_hit_tokens, budget)
                if not self.kv_cache.allocate_slots(seq, num_new, hits):
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

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Called by the engine when a running sequence stops: its blocks go back (and stay cached)."""
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.status = SequenceStatus.FINISHED
