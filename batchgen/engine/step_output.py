"""What the model runner hands back from one step, for the scheduler to apply to its sequences."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .sequence import Sequence

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class StepOutput:
    sampled: list[Sequence] = field(default_factory=list)  # sequences that sampled a token, in `tokens` order
    tokens: list[int] = field(default_factory=list)
    # Per sampled sequence: (the token's logprob, top alternatives) when it asked for logprobs, else None
    logprobs: list[tuple[float, TopLogprobs] | None] = field(default_factory=list)
    # SCORE sequences: (sequence, first position, logprob of the token after each position, their top alternatives)
    scores: list[tuple[Sequence, int, list[float], list[TopLogprobs] | None]] = field(default_factory=list)
    # POOL sequences: (sequence, first position computed, what the step kept of it: pooler.pool_rows)
    pooled: list[tuple[Sequence, int, Any]] = field(default_factory=list)
