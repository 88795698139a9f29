"""task: score with score.continuation_column: each row scores its continuation given its prompt (the context), split
as lm-evaluation-harness splits a loglikelihood request: the context's trailing whitespace moves to the continuation,
whole = tokenize(context + continuation), context = tokenize(context), and the continuation's tokens are
whole[len(context):], so that the boundary's tokens are those the whole text has. The request's tokens are the
context's then the continuation's, scored from the first continuation token on (PoolingParams.score_from)."""
from __future__ import annotations

import dataclasses
from typing import Any

from .rows import RowError, SourceRow
from .special_tokens import PromptText, SpecialTokenError


class ScoreSplit:
    def __init__(self, builder: Any):  # the source's PromptBuilder
        self.builder = builder
        self.column: str = builder.continuation_column

    def build(self, batch: list[tuple[int, dict[str, Any]]]) -> list[SourceRow]:
        b = self.builder
        rows, prompts = [], []
        for position, values in batch:
            ident = values[b.input.id_column] if b.input.id_column else position
            keep = tuple(values[c] for c in b.keep_columns)
            try:
                prompts.append((*self.texts(values), b.is_raw(values)))
                rows.append(SourceRow(position, ident, keep, None, b.default_params))
            except (RowError, SpecialTokenError) as exc:
                rows.append(SourceRow(position, ident, keep, None, None, error=str(exc)))
        ok = [row for row in rows if row.error is None]
        for flag in sorted({raw for _, _, raw in prompts}):
            chosen = [i for i, (_, _, raw) in enumerate(prompts) if raw == flag]
            encoded = b.encoder.encode([prompts[i][0] for i in chosen] + [prompts[i][1] for i in chosen],
                                       add_special_tokens=flag)
            for k, i in enumerate(chosen):
                self.attach(ok[i], encoded[k], encoded[len(chosen) + k])
        return rows

    def texts(self, values: dict[str, Any]) -> tuple[PromptText, PromptText]:
        """The row's context and its whole text (context + continuation), ready to tokenize."""
        b, column = self.builder, self.column
        continuation = values[column]
        if continuation is None:
            raise RowError(f"continuation is null (column {column!r})")
        if not isinstance(continuation, str):
            raise RowError(f"continuation must be a string, got {type(continuation).__name__} (column {column!r})")
        if not continuation:
            raise RowError(f"continuation is empty (column {column!r})")
        try:
            context = b.checked_size(b.prompt_text(values))
        except RowError as exc:
            if str(exc) != "prompt is empty":
                raise
            raise RowError(f"context is empty (column {self.context_column!r})") from None
        spaces = len(context.text) - len(context.text.rstrip())
        if spaces:  # lm-eval's rule: the whitespace between the two belongs to the continuation
            continuation = context.text[-spaces:] + continuation
            context = dataclasses.replace(context, text=context.text[:-spaces])
        return context, b.checked_size(self.joined(context, b.encoder.raw(continuation), column))

    @property
    def context_column(self) -> str:
        cfg = self.builder.input
        return cfg.messages_column or (cfg.template if cfg.template is not None else cfg.prompt_column)

    def joined(self, context: PromptText, continuation: PromptText, column: str) -> PromptText:
        """context + continuation as one prompt. Special-token text from the data stands in as one token per prompt
        (special_tokens.py): the continuation may hold such text only where the context holds none and its stand-in
        token is not in the context's text (a chat template's own markers)."""
        if continuation.stand_in is None:
            return PromptText(context.text + continuation.text, context.stand_in, context.plain)
        stand_in = next(text for text, i in self.builder.encoder.stand_ins if i == continuation.stand_in)
        if context.stand_in is None and stand_in not in context.text:
            return PromptText(context.text + continuation.text, continuation.stand_in, continuation.plain)
        raise RowError(f"special-token text in both the context and the continuation (column {column!r}) is not "
                       f"supported; set input.allow_special_tokens: true to read it as special tokens")

    def attach(self, row: SourceRow, context_ids: list[int], whole_ids: list[int]) -> None:
        b = self.builder
        continuation_ids = whole_ids[len(context_ids):]
        if not context_ids:
            row.error, row.sampling = f"context is empty after tokenization (column {self.context_column!r})", None
            return
        if not continuation_ids:
            row.error, row.sampling = f"continuation is empty after tokenization (column {self.column!r})", None
            return
        b.attach_tokens(row, context_ids + continuation_ids)
        if row.error is None:
            row.pooling = dataclasses.replace(b.default_pooling, score_from=len(context_ids))
