"""What the source makes of an input row (a SourceRow: its tokens and settings, or its error), a leaf that the
source and the score split (score_split.py) both build."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.engine.request import PoolingParams, SamplingParams


@dataclass(slots=True)
class SourceRow:
    row: int  # position in the input, across files in sorted file order
    id: Any
    keep: tuple  # values of output.keep_columns
    token_ids: list[int] | None  # None when the row is an error
    sampling: SamplingParams | None
    error: str | None = None
    prompt_tokens: int = 0
    pooling: PoolingParams | None = None  # a prefill-only task's settings (embed, classify, score)
    lora: str | None = None  # the LoRA adapter that answers it (a name of the job's lora:); None: the base model


class RowError(ValueError):
    """Why one row cannot be generated; becomes that row's `error`."""
