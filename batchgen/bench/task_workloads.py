"""The rows of the prefill-only workloads (`--workload embed | classify | score`): plain texts, no chat template, of
several lengths (short, medium, and long ones past an encoder's 256-token maximum), built from the generation
workload's word lists, deterministic from a seed. Every system gets the same texts; batchgen the token ids its
tokenizer makes of them (special tokens as the tokenizer adds them, as `batchgen run` tokenizes a plain prompt)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from .workloads import review_or_ticket, sentence

TASK_WORKLOADS = ("embed", "classify", "score")
# (kind, share of the rows, token range): the long ones run past all-MiniLM's max_seq_length of 256
LENGTHS = (("short", 0.4, (8, 40)), ("medium", 0.4, (60, 200)), ("long", 0.2, (300, 600)))


@dataclass
class TextRow:
    id: int
    text: str
    token_ids: list[int]  # the whole text's, before any cut to the model's maximum length
    kind: str  # short | medium | long


@dataclass
class TextWorkload:
    name: str  # embed | classify | score
    model: str  # what EngineArgs.model takes
    rows: list[TextRow]
    max_length: int | None = None  # the model's maximum input length (an encoder's cut), None: no cut
    notes: list[str] = field(default_factory=list)

    def tokens_run(self, row: TextRow) -> int:
        """The tokens a system computes for the row: its text's, cut to the model's maximum length."""
        return len(row.token_ids) if self.max_length is None else min(len(row.token_ids), self.max_length)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.tokens_run(row) for row in self.rows)

    def describe(self) -> dict[str, Any]:
        lengths = sorted(len(row.token_ids) for row in self.rows) or [0]
        kinds = {kind: sum(1 for row in self.rows if row.kind == kind) for kind, _, _ in LENGTHS}
        truncated = sum(1 for row in self.rows if self.tokens_run(row) < len(row.token_ids))
        return {"name": self.name, "model": self.model, "rows": len(self.rows), "prompt_tokens": self.prompt_tokens,
                "text_tokens": sum(lengths), "prompt_tokens_min": lengths[0], "prompt_tokens_max": lengths[-1],
                "max_length": self.max_length, "rows_by_length": kinds, "rows_truncated": truncated,
                "max_output_tokens": 0, "notes": self.notes}


def text_row(rng: random.Random, tokenizer: Any, row_id: int, kind: str, token_range: tuple[int, int]) -> TextRow:
    """A review or support ticket (or, for a third of the rows, notes of plain sentences) grown to its length."""
    if rng.random() < 2 / 3:
        head, more = review_or_ticket(rng)
    else:
        head, more = sentence(rng), sentence
    target = rng.randint(*token_range)
    parts = [head]
    ids = list(tokenizer(head)["input_ids"])
    while len(ids) < target:
        parts.append(more(rng))
        ids = list(tokenizer(" ".join(parts))["input_ids"])
    return TextRow(row_id, " ".join(parts), ids, kind)


def text_workload(name: str, num_rows: int, seed: int, tokenizer: Any, model: str,
                  max_length: int | None) -> TextWorkload:
    if name not in TASK_WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(TASK_WORKLOADS)}; got {name!r}")
    rng = random.Random(seed)
    kinds = []
    for kind, share, _ in LENGTHS:
        kinds += [kind] * round(num_rows * share)
    kinds = (kinds + ["medium"] * num_rows)[:num_rows]
    if num_rows >= len(LENGTHS):  # every length present, however few the rows
        kinds[:len(LENGTHS)] = [kind for kind, _, _ in LENGTHS]
    rng.shuffle(kinds)
    ranges = {kind: token_range for kind, _, token_range in LENGTHS}
    rows = [text_row(rng, tokenizer, i, kind, ranges[kind]) for i, kind in enumerate(kinds)]
    workload = TextWorkload(name, model, rows, max_length)
    if max_length is not None:
        workload.notes.append(f"texts past the model's {max_length} tokens are cut to it (every system)")
    return workload


def encoder_max_length(model_dir: Any, tokenizer: Any) -> int | None:
    """An encoder's input limit as sentence-transformers applies it (max_seq_length), else the tokenizer's and the
    config's position limit, whichever is smaller."""
    import json
    from pathlib import Path

    limits = []
    st_config = Path(model_dir, "sentence_bert_config.json")
    if st_config.is_file():
        limits.append(json.loads(st_config.read_text()).get("max_seq_length"))
    config = Path(model_dir, "config.json")
    if config.is_file():
        limits.append(json.loads(config.read_text()).get("max_position_embeddings"))
    limits.append(getattr(tokenizer, "model_max_length", None))
    limits = [limit for limit in limits if isinstance(limit, int) and 0 < limit < 1_000_000]
    return min(limits) if limits else None
