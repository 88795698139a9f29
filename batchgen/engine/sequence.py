"""The engine's running state of one request: its tokens, its KV blocks and its timeline."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .block_pool import KVBlock, hash_block
from .request import Request, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    PENDING = "pending"  # a fork waiting for its PREFIX sequence to be computed: not in the scheduler yet
    HELD = "held"  # a computed PREFIX keeping its blocks for the forks it has not started yet


class SequenceRole(enum.Enum):
    """What a sequence's last computed token leads to."""

    GENERATE = "generate"  # sample a token, append it, go on until a stop rule
    PREFIX = "prefix"  # nothing: a request's shared prompt, computed once, then forked (request_group.py)
    SCORE = "score"  # nothing sampled: its tokens are given, and the logprob of each next one is recorded
    POOL = "pool"  # nothing sampled: its prompt's final hidden states are pooled (task embed or classify: pooler.py)


class BlockIds:
    """A sequence's KV block ids as a growing int32 array. The KV cache manager appends to it as it hands out
    blocks, so the model runner copies a row of a step's block table instead of walking the blocks."""

    __slots__ = ("_ids", "count")

    def __init__(self) -> None:
        self._ids = np.empty(16, dtype=np.int32)
        self.count = 0

    @property
    def array(self) -> np.ndarray:
        return self._ids[: self.count]

    def extend(self, blocks: list[KVBlock]) -> None:
        end = self.count + len(blocks)
        if end > len(self._ids):
            grown = np.empty(max(2 * len(self._ids), end), dtype=np.int32)
            grown[: self.count] = self._ids[: self.count]
            self._ids = grown
        self._ids[self.count:end] = [block.block_id for block in blocks]
        self.count = end

    def clear(self) -> None:
        self.count = 0

    def copy(self) -> "BlockIds":
        other = BlockIds()
        other._ids = self._ids.copy()
        other.count = self.count
        return other

    def replace(self, index: int, block: KVBlock) -> None:
        self._ids[index] = block.block_id

    def fill(self, start: int, end: int, block: KVBlock) -> None:
        """Entries start .. end - 1 name `block` (a sliding-window group's null block)."""
        self._ids[start:end] = block.block_id


@dataclass(frozen=True)
class AdapterIdentity:
    """A sequence's LoRA adapter (lora/attach.py): its name (None: the base model), and the salt its prefix-cache
    keys start from, so that KV computed under one adapter is never found by another's (or the base's) prompt. The
    adapter's slot in the model is given at each step (lora.AdapterSlots): an adapter may move between slots."""

    name: str | None = None
    salt: bytes | None = None


BASE_MODEL = AdapterIdentity()


@dataclass(eq=False)
class Sequence:
    """`num_computed_tokens` catches up with `num_tokens` (prompt + generated); whenever it does, the step that
    computed the last token also samples the next one."""

    request_id: Any
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    arrival_time: float  # time.monotonic()
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    block_ids: BlockIds = field(default_factory=BlockIds)  # the ids of `blocks`, kept in step by the cache manager
    block_hashes: list[bytes] = field(default_factory=list)
    # The local KV group's blocks (a model with sliding-window layers beside global ones): one per block of
    # `blocks`, its null block where the window has left (sliding_window.py); their ids, made by that group
    local_blocks: list[KVBlock] = field(default_factory=list)
    local_block_ids: BlockIds | None = None
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until then
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    detokenizer: Any = None  # an IncrementalDetokenizer when the request has stop strings
    penalty_state: Any = None  # a sampler.PenaltyState when the request has a repetition/presence/frequency penalty
    role: SequenceRole = SequenceRole.GENERATE
    sample_index: int = 0  # which of its request's n samples (or, for a SCORE sequence, which candidate)
    # A PREFIX's forks not started yet, in order: len() of them, popleft() the next (request_group.Forks); the
    # scheduler starts them in waves once the PREFIX is computed
    forks: Any = None
    num_live_forks: int = 0  # a PREFIX's forks started and not finished
    parent: "Sequence | None" = None  # a fork's PREFIX
    matcher: Any = None  # a structured.Matcher when the output is constrained by a grammar
    # With params.logprobs: per output token, its logprob and the top alternatives as (token id, logprob)
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # A SCORE sequence: the logprob of each token from position score_from + 1 on, and after the last one of
    # ending there (EOS); filled as positions are computed (again after a preemption: same values)
    score_from: int = 0
    scores: list[float] | None = None
    score_tops: list[list[tuple[int, float]]] | None = None
    scores_end: bool = True  # the value of ending after the last token is scored too (`choice`; not task score)
    # A POOL sequence: "last" or "mean" (pooler.py), and what its steps kept: the last row (or the head's logits of
    # it), or the sum of the rows so far
    pooling: str | None = None
    pooled: Any = None
    adapter: AdapterIdentity = BASE_MODEL
    # This step's guessed next tokens (speculative decoding), computed after its last token; [] between steps
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_computed: int = 0  # of its tokens, those a draft model's cache holds (speculative/draft.py)

    @classmethod
    def from_request(cls, request: Request, seed: int) -> "Sequence":
        return cls(request.request_id, list(request.prompt_token_ids), len(request.prompt_token_ids),
                   request.sampling_params, seed, time.monotonic())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        if self.penalty_state is not None:
            self.penalty_state.append(token)
        if self.matcher is not None and not self.matcher.accept(token):
            raise RuntimeError(f"request {self.request_id!r}: the grammar refused token {token}, which its own "
                               f"bitmask allowed")

    @property
    def samples(self) -> bool:
        return self.role is SequenceRole.GENERATE

    @property
    def num_cacheable_tokens(self) -> int:
        """How many leading tokens a prefix-cache hit may cover: all but those whose logits are needed."""
        if self.role is SequenceRole.SCORE:
            return self.score_from
        return 0 if self.pooling == "mean" else self.num_tokens - 1

    @property
    def score_until(self) -> int:
        """A SCORE sequence's scored positions are score_from .. this - 1 (the last one: the end's value)."""
        return self.num_tokens if self.scores_end else self.num_tokens - 1

    def record_pooled(self, first_position: int, vector: Any) -> None:
        """A POOL sequence's kept vector of a step that computed from first_position on: a mean's rows are summed
        from position 0 on (a recomputation after a preemption starts over)."""
        if self.pooling == "mean" and first_position > 0:
            self.pooled = self.pooled + vector
        else:
            self.pooled = vector

    def append_logprobs(self, logprob: float, top: list[tuple[int, float]]) -> None:
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)

    def record_scores(self, first_position: int, values: list[float], tops: list[list[tuple[int, float]]] | None):
        """A SCORE sequence's logprobs of the tokens after positions first_position, first_position + 1, ..."""
        start = first_position - self.score_from
        self.scores[start:start + len(values)] = values
        if tops is not None:
            self.score_tops[start:start + len(tops)] = tops

    def full_block_hashes(self, block_size: int, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks within the first num_tokens tokens, extended incrementally."""
        for i in range(len(self.block_hashes), num_tokens // block_size):
            parent = self.block_hashes[-1] if self.block_hashes else self.adapter.salt
            self.block_hashes.append(hash_block(parent, self.token_ids[i * block_size:(i + 1) * block_size]))
        return self.block_hashes[: num_tokens // block_size]
