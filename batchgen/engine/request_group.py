"""A request as the sequences that compute it, and their Results once all have finished.

- One sample, no `choice`: one GENERATE sequence.
- n samples: a PREFIX sequence computes the prompt but its last token once; then n GENERATE forks share its blocks,
  each computes the last prompt token itself and samples on with its own seed (sample i depends on (seed, i) alone).
  The scheduler starts the forks in waves of at most max_num_seqs, the PREFIX's blocks held until the last starts.
- `choice`: the PREFIX as above, then one SCORE fork per candidate, teacher-forced through the candidate's tokens:
  the logprob of each of them and of ending after them (any EOS token) sum to the candidate's total. The output is
  the most probable candidate (greedy) or one drawn from the candidates' renormalised distribution, and every
  candidate's probability comes with it. Cost: one prompt prefill, plus 1 + len(candidate) tokens per candidate.
A one-token prompt has nothing to share: its forks start on their own.
A prefill-only request (EngineArgs.task embed, classify or score) is a PrefillGroup: one POOL or SCORE sequence.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .pooler import LAST, Classifier, ModelPooling, PrefillPrompt, classification, embedding
from .request import PoolingParams, Request, Result, SamplingParams
from .sampler import GREEDY_TEMPERATURE, hash_uniforms, _to_signed
from .sequence import BASE_MODEL, AdapterIdentity, Sequence, SequenceRole, SequenceStatus

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: the seed itself for sample 0 (so n = 1 keeps
    its outputs), splitmix64 of (seed, index) for the others."""
    if index == 0:
        return seed
    x = (seed + index * _GOLDEN_GAMMA) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


class Forks:
    """A PREFIX's forks not started yet, in order. The scheduler takes each with popleft() as it starts it, and a
    `choice` candidate's sequence is made only then: a choice of thousands of labels holds a wave of sequences,
    not one per label."""

    def __init__(self, count: int, make: Callable[[int], Sequence]) -> None:
        self._make, self._next, self._count = make, 0, count

    def __len__(self) -> int:
        return self._count - self._next

    def popleft(self) -> Sequence:
        seq = self._make(self._next)
        self._next += 1
        return seq


class RequestGroup:
    def __init__(self, request: Request, seed: int, candidates: list[list[int]] | None, new_matcher,
                 adapter: AdapterIdentity = BASE_MODEL) -> None:
        """candidates: the token ids of each `choice` string, None without `choice`. new_matcher() returns a
        fresh structured.Matcher for a constrained request, None otherwise. adapter: its LoRA adapter's."""
        self.request_id = request.request_id
        self.adapter = adapter
        self.params = params = request.sampling_params
        self.seed = seed
        self.prompt = list(request.prompt_token_ids)
        self.candidates = candidates
        self.prefix: Sequence | None = None
        self.members: list[Sequence] = []  # made up front: the samples; a choice's candidates only without a PREFIX
        self.started: dict[int, Sequence] = {}  # candidates the PREFIX's Forks made, not finished yet, by index
        self.finished: list[Sequence] = []  # the samples that finished
        self.num_finished = 0
        self.finish_time = 0.0  # the last member's
        self.num_preemptions = 0  # the most of any member's
        self.arrival_time = time.monotonic()
        count = params.n if candidates is None else len(candidates)
        if candidates is not None:
            self.totals = [0.0] * count  # each candidate's total logprob, filled as its sequence finishes
            self.candidate_scores: dict[int, tuple[list[float], list]] = {}  # with logprobs: (scores, tops)
        if count > 1 and len(self.prompt) > 1:
            self.prefix = self._sequence(SequenceRole.PREFIX, self.prompt[:-1], len(self.prompt) - 1, 0, None)
        if candidates is None:
            self.members = [self._sequence(SequenceRole.GENERATE, self.prompt, len(self.prompt), i,
                                           new_matcher()) for i in range(count)]
            if self.prefix is not None:
                for member in self.members:
                    member.status = SequenceStatus.PENDING
                self.prefix.forks = Forks(count, self.members.__getitem__)
        elif self.prefix is not None:
            self.prefix.forks = Forks(count, self._start_candidate)
        else:
            self.members = [self._score_sequence(i, tokens) for i, tokens in enumerate(candidates)]

    @property
    def first_sequences(self) -> list[Sequence]:
        """What goes to the scheduler now: the PREFIX (whose forks follow once it is computed), or the members."""
        return [self.prefix] if self.prefix is not None else self.members

    @property
    def sequences(self) -> list[Sequence]:
        """Every sequence made so far that may still hold blocks or wait (finished ones included)."""
        return ([self.prefix] if self.prefix is not None else []) + self.members + list(self.started.values())

    def _start_candidate(self, index: int) -> Sequence:
        seq = self._score_sequence(index, self.candidates[index])
        self.started[index] = seq
        return seq

    def _sequence(self, role: SequenceRole, token_ids: list[int], num_prompt_tokens: int, index: int,
                  matcher: Any) -> Sequence:
        seed = sample_seed(self.seed, index) if role is SequenceRole.GENERATE else self.seed
        seq = Sequence(self.request_id, list(token_ids), num_prompt_tokens, self.params, seed, self.arrival_time,
                       role=role, sample_index=index, matcher=matcher, adapter=self.adapter)
        if role is SequenceRole.GENERATE and self.params.logprobs is not None:
            seq.token_logprobs, seq.top_logprobs = [], []
        return seq

    def _score_sequence(self, index: int, tokens: list[int]) -> Sequence:
        seq = self._sequence(SequenceRole.SCORE, self.prompt + tokens, len(self.prompt), index, None)
        seq.score_from = len(self.prompt) - 1
        seq.scores = [0.0] * (len(tokens) + 1)
        if self.params.logprobs is not None:
            seq.score_tops = [[] for _ in range(len(tokens) + 1)]
        return seq

    def on_finished(self, seq: Sequence) -> bool:
        """Note a finished sequence (a candidate's scores are kept as its total); True once every member has."""
        if seq is self.prefix:
            return False
        self.num_finished += 1
        self.finish_time = max(self.finish_time, seq.finish_time)
        self.num_preemptions = max(self.num_preemptions, seq.num_preemptions)
        if seq.role is SequenceRole.SCORE:
            self.started.pop(seq.sample_index, None)
            self.totals[seq.sample_index] = math.fsum(seq.scores)
            if self.params.logprobs is not None:
                self.candidate_scores[seq.sample_index] = (seq.scores, seq.score_tops)
            return self.num_finished == len(self.totals)
        self.finished.append(seq)
        return self.num_finished == self.params.n

    # -- results -------------------------------------------------------------------------------------------------

    def results(self, output) -> list[Result]:
        """The request's Results, sample 0 first. `output` is the engine's OutputProcessor."""
        if self.candidates is None:
            return [output.result(seq) for seq in sorted(self.finished, key=lambda s: s.sample_index)]
        return self._choice_results(output)

    def choice_totals(self) -> list[float]:
        """Each candidate's total logprob (its tokens, then the end), in `choice` order."""
        return self.totals

    def _choice_results(self, output) -> list[Result]:
        totals = self.choice_totals()
        best = max(totals)
        weights = [math.exp(t - best) for t in totals]
        probs = [w / math.fsum(weights) for w in weights]
        choice_probs = list(zip(self.params.choice, probs))
        first = self.prefix if self.prefix is not None else self.members[0]
        num_preemptions = max(self.num_preemptions, first.num_preemptions)
        wall = output.clock.wall
        results = []
        for index in range(self.params.n):
            picked = self._pick(totals, index)
            result = Result(
                request_id=self.request_id, text=self.params.choice[picked], token_ids=list(self.candidates[picked]),
                finish_reason="stop", error=None, prompt_tokens=len(self.prompt),
                output_tokens=len(self.candidates[picked]), cached_tokens=max(first.num_cached_tokens, 0),
                num_preemptions=num_preemptions,
                arrival_time=wall(first.arrival_time), first_scheduled_time=wall(first.first_scheduled_time),
                first_token_time=wall(self.finish_time), finish_time=wall(self.finish_time), sample_index=index,
                choice_probs=choice_probs, choice_logprobs=totals, lora=self.adapter.name)
            if self.params.logprobs is not None:
                scores, tops = self.candidate_scores[picked]
                result.logprobs = scores[:-1]
                result.top_logprobs = [output.named_top(top) for top in tops[:-1]]
            results.append(result)
        return results

    def _pick(self, totals: list[float], index: int) -> int:
        """Greedy: the most probable candidate (the first of equals). Otherwise a draw from the candidates'
        distribution at the request's temperature, random in (seed, index) alone."""
        if self.params.temperature < GREEDY_TEMPERATURE:
            return totals.index(max(totals))
        scaled = torch.tensor(totals, dtype=torch.float64) / self.params.temperature
        weights = (scaled - scaled.max()).exp()
        seed = torch.tensor([_to_signed(sample_seed(self.seed, index))])
        candidates = torch.arange(len(totals)).view(1, -1)
        uniforms = hash_uniforms(seed, torch.zeros(1, dtype=torch.long), candidates)[0].double()
        return int((weights / -torch.log(uniforms)).argmax())


class PrefillGroup:
    """A prefill-only request (EngineArgs.task embed, classify or score): one sequence that computes its prompt and
    samples nothing, and the Result built from what it kept (pooler.py). Its sampling parameters are ignored."""

    def __init__(self, request: Request, prompt: PrefillPrompt, task: str, params: PoolingParams,
                 classifier: Classifier | None, defaults: ModelPooling) -> None:
        self.request_id = request.request_id
        self.task, self.params, self.classifier, self.defaults = task, params, classifier, defaults
        self.num_truncated = prompt.num_truncated
        ids = prompt.token_ids
        seq = Sequence(request.request_id, list(ids), len(ids), SamplingParams(), 0, time.monotonic(),
                       role=SequenceRole.SCORE if task == "score" else SequenceRole.POOL)
        if task == "score":  # positions score_from - 1 .. len - 2 predict the scored tokens; the end is not scored
            seq.score_from, seq.scores_end = params.score_from - 1, False
            seq.scores = [0.0] * (len(ids) - params.score_from)
        else:  # a classification head reads the last token, as transformers' *ForSequenceClassification
            seq.pooling = LAST if task == "classify" else (params.pooling or defaults.pooling)
        self.members = [seq]

    @property
    def first_sequences(self) -> list[Sequence]:
        return self.members

    @property
    def sequences(self) -> list[Sequence]:
        return self.members

    def on_finished(self, seq: Sequence) -> bool:
        return True

    def results(self, output) -> list[Result]:
        (seq,) = self.members
        wall = output.clock.wall
        if self.task == "score":
            fields = dict(prompt_logprobs=list(seq.scores))
        elif self.task == "embed":
            fields = dict(embedding=embedding(seq, self.params, self.defaults))
        else:
            fields = classification(seq.pooled, self.classifier)
        return [Result(request_id=self.request_id, text="", token_ids=[], finish_reason="stop", error=None,
                       prompt_tokens=seq.num_prompt_tokens, output_tokens=0,
                       cached_tokens=max(seq.num_cached_tokens, 0), num_preemptions=seq.num_preemptions,
                       arrival_time=wall(seq.arrival_time), first_scheduled_time=wall(seq.first_scheduled_time),
                       first_token_time=wall(seq.finish_time), finish_time=wall(seq.finish_time),
                       num_truncated_tokens=self.num_truncated, **fields)]
