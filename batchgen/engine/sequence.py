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
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until then
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    detokenizer: Any = None  # an IncrementalDetokenizer when the request has stop strings
    penalty_state: Any = None  # a sampler.PenaltyState when the request has a repetition/presence/frequency penalty

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

    def full_block_hashes(self, block_size: int, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks within the first num_tokens tokens, extended incrementally."""
        for i in range(len(self.block_hashes), num_tokens // block_size):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, self.token_ids[i * block_size:(i + 1) * block_size]))
        return self.block_hashes[: num_tokens // block_size]
