"""The input side of a job: stream the rows of the input files (found and checked by inputs.py) in record
batches, build each row's prompt, tokenize it, and sort within a window so rows sharing a prefix reach the engine
together.

A row whose prompt or per-row values are unusable comes out as a SourceRow with `error` set and no tokens;
it never reaches the engine."""
from __future__ import annotations

import dataclasses
import math
import string
from typing import Any, Iterable, Iterator, Protocol

from batchgen.engine.request import CONSTRAINT_KEYS, SamplingParams

from ..config import ROW_INTEGER_KEYS, ROW_SAMPLING_KEYS, JobConfig
from ..task_config import GENERATE, pooling_params
from .files import InputFiles, lora_column, read_columns, required_columns
from .parquet_read import Unreadable, batch_values, file_batches, file_range
from .parquet_read import first_line as _first_line
from .rows import RowError, SourceRow
from .score_split import ScoreSplit
from .special_tokens import PromptEncoder, PromptText, SpecialTokenError
from .text_formats import INPUT_ERROR_COLUMN


class Tokenizer(Protocol):
    """What the source needs of a Hugging Face tokenizer."""

    # Also read where present: added_tokens_decoder, {id: AddedToken}, for the special tokens (special_tokens.py).

    def __call__(self, texts: list[str], add_special_tokens: bool,
                 split_special_tokens: bool = False) -> Any: ...  # -> {"input_ids": [[int]]}

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str: ...


# More characters a token than any real text averages: a prompt longer than this many characters a token of its
# context cannot fit it, and is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 32

# The roles a messages column may use: what chat templates know.
MESSAGE_ROLES = ("system", "user", "assistant", "tool")


# -- reading, prompt building, tokenizing, sorting ---------------------------------------------------------------

def read_source(config: JobConfig, inputs: InputFiles, tokenizer: Tokenizer, max_model_len: int | None,
                done: bytearray | None = None, context_limit: str | None = None) -> Iterator[SourceRow]:
    """Stream the job's rows, skipping those marked in `done`, sorted within windows of `input.sort_window`.
    `context_limit` says which limit max_model_len is, for the error of a prompt too long for it."""
    builder = PromptBuilder(config, inputs, tokenizer, max_model_len, context_limit)
    built = (row for batch in read_batches(config, inputs, done) for row in build_rows(config, builder, batch))
    return sort_windows(built, config.input.sort_window, config.input.sort)


def read_batches(config: JobConfig, inputs: InputFiles,
                 done: bytearray | None = None) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    """Record batches as lists of (row position, {column: value}), rows in `done` left out. A value that cannot
    become a Python value is Unreadable; a file that cannot be read raises InputReadError."""
    columns = read_columns(config, inputs.column_types)
    first_row = 0
    for i, (path, count) in enumerate(zip(inputs.files, inputs.row_counts)):
        if done is not None and all(done[first_row:first_row + count]):
            first_row += count
            continue
        position = first_row
        for batch in file_batches(path, columns, config.input.read_batch_rows, count, inputs.partition(i)):
            values = batch_values(batch)
            rows = []
            for i in range(batch.num_rows):
                if done is None or not done[position + i]:
                    rows.append((position + i, {c: column[i] for c, column in values.items()}))
            position += batch.num_rows
            if rows:
                yield rows
        first_row += count


def read_window(config: JobConfig, inputs: InputFiles, builder: PromptBuilder, start: int, stop: int,
                done: bytes | None = None) -> list[SourceRow]:
    """Input rows [start, stop) (positions across files), those marked in `done` (done[i]: position start + i)
    left out, as SourceRows sorted as `input.sort` says: one window of the Ray executor, read where it runs."""
    columns = read_columns(config, inputs.column_types)
    rows: list[SourceRow] = []
    first_row = 0
    for i, (path, count) in enumerate(zip(inputs.files, inputs.row_counts)):
        if first_row < stop and first_row + count > start:
            position = max(start, first_row)
            for batch in file_range(path, columns, position - first_row, min(stop, first_row + count) - first_row,
                                    inputs.partition(i)):
                values = batch_values(batch)
                picked = [(position + i, {c: column[i] for c, column in values.items()})
                          for i in range(batch.num_rows) if done is None or not done[position + i - start]]
                position += batch.num_rows
                if picked:
                    rows += build_rows(config, builder, picked)
        first_row += count
    return list(sort_windows(rows, max(len(rows), 1), config.input.sort))


def build_rows(config: JobConfig, builder: PromptBuilder,
               batch: list[tuple[int, dict[str, Any]]]) -> list[SourceRow]:
    """The batch's SourceRows, in input order; a row holding an Unreadable value, or a text input's line that could
    not be a row (its `_input_error`), is an error row."""
    unreadable = [(position, values) for position, values in batch if _has_unreadable(values)]
    if not unreadable:
        return builder.build(batch)
    rows = builder.build([(position, values) for position, values in batch if not _has_unreadable(values)])
    rows += [unreadable_row(config, position, values) for position, values in unreadable]
    return sorted(rows, key=lambda row: row.row)


def _has_unreadable(values: dict[str, Any]) -> bool:
    return values.get(INPUT_ERROR_COLUMN) is not None or any(isinstance(value, Unreadable)
                                                             for value in values.values())


# What a column is to the row, for the error of a row whose value in it is Unreadable.
COLUMN_ROLES = {"input.prompt_column": "prompt", "input.template": "prompt", "input.messages_column": "prompt",
                "input.system_column": "system prompt", "input.id_column": "id", "output.keep_columns": "value",
                "input.lora_column": "lora adapter name",
                "score.continuation_column": "continuation"}


def unreadable_row(config: JobConfig, position: int, values: dict[str, Any]) -> SourceRow:
    """The error row of a row holding an Unreadable value (or an `_input_error`). Its id and kept values are written,
    the unreadable ones as null (e.g. bytes that are not UTF-8 have no place in a string column)."""
    readable = lambda value: None if isinstance(value, Unreadable) else value
    ident = readable(values[config.input.id_column]) if config.input.id_column else position
    keep = tuple(readable(values[column]) for column in config.output.keep_columns)
    if values.get(INPUT_ERROR_COLUMN) is not None:
        return SourceRow(position, ident, keep, None, None, error=values[INPUT_ERROR_COLUMN])
    columns = required_columns(config) + [("sampling", key) for key in ROW_SAMPLING_KEYS]
    if config.input.lora_column:
        columns.append(("input.lora_column", config.input.lora_column))
    key, column = next((key, column) for key, column in columns if isinstance(values.get(column), Unreadable))
    return SourceRow(position, ident, keep, None, None,
                     error=f"{COLUMN_ROLES.get(key, 'value')} {values[column].problem} (column {column!r})")


def render_template(template: str, values: dict[str, Any]) -> str:
    """str.format over the row's columns, field by field, so that a value its format spec does not suit fails
    this row with the column named."""
    parts = []
    for literal, column, spec, _ in string.Formatter().parse(template):
        parts.append(literal)
        if column is None:
            continue
        value = values[column]
        if value is None:
            raise RowError(f"column {column!r} is null")
        try:
            parts.append(format(value, spec))
        except Exception as exc:  # the value's own __format__ decides what it raises (ValueError, OverflowError...)
            field = f"{{{column}:{spec}}}" if spec else f"{{{column}}}"
            raise RowError(f"input.template: {field} cannot format this row's value of column {column!r}: "
                           f"{_first_line(exc)}") from None
    return "".join(parts)


class PromptBuilder:
    """Turns input rows into SourceRows: prompt text (template / system / chat template), token ids and the
    row's sampling parameters, or an error."""

    def __init__(self, config: JobConfig, inputs: InputFiles, tokenizer: Tokenizer, max_model_len: int | None,
                 context_limit: str | None = None):
        self.input = config.input
        self.sampling = config.sampling
        self.task, self.task_section = config.task, config.task_section
        self.keep_columns = config.output.keep_columns
        self.row_sampling_keys = [k for k in ROW_SAMPLING_KEYS if k in inputs.column_types] \
            if self.task == GENERATE else []  # the other tasks generate nothing: no sampling columns are read
        self.continuation_column = getattr(self.task_section, "continuation_column", None)
        self.adapters = tuple(config.engine.lora or ())
        self.lora_column = lora_column(config, inputs.column_types)
        self.lora_default = config.lora_default
        self.scorer = ScoreSplit(self) if self.continuation_column else None
        own = config.input.chat_template if isinstance(config.input.chat_template, str) else None
        self.encoder = PromptEncoder(tokenizer, config.input.allow_special_tokens, own)
        self.max_model_len = max_model_len
        self.context_limit = context_limit or f"the model's context window is {max_model_len} tokens"
        # Rows without overrides share one params object (validated with the job); nothing mutates it.
        self.default_params = self.sampling.params()
        self.default_pooling = None if self.task_section is None else pooling_params(self.task_section)
        if self.task == "score":  # logprob_sum is the sum of the scored tokens' logprobs: the engine returns each
            self.default_pooling = dataclasses.replace(self.default_pooling, token_logprobs=True)

    def build(self, batch: list[tuple[int, dict[str, Any]]]) -> list[SourceRow]:
        if self.scorer is not None:
            return self.scorer.build(batch)
        rows, prompts, given_ids, raw = [], [], [], []
        for position, values in batch:
            ident = values[self.input.id_column] if self.input.id_column else position
            keep = tuple(values[c] for c in self.keep_columns)
            try:
                sampling = self.row_sampling(values)
                row = SourceRow(position, ident, keep, None, sampling, pooling=self.default_pooling,
                                lora=self.row_lora(values))
                ids = values.get("prompt_token_ids") if self.input.format == "openai-batch" else None
                if ids is not None:  # an embeddings request's input as token ids: used as they are
                    given_ids.append((row, list(ids)))
                else:
                    prompts.append(self.checked_size(self.prompt_text(values)))
                    raw.append(self.is_raw(values))  # no chat template: the tokenizer's own special tokens
                rows.append(row)
            except (RowError, SpecialTokenError) as exc:
                rows.append(SourceRow(position, ident, keep, None, None, error=str(exc)))
        for row, ids in given_ids:
            self.attach_tokens(row, ids)
        given = {id(row) for row, _ in given_ids}
        ok = [row for row in rows if row.error is None and id(row) not in given]
        for flag in sorted(set(raw)):
            chosen = [i for i, r in enumerate(raw) if r == flag]
            encoded = self.encoder.encode([prompts[i] for i in chosen], add_special_tokens=flag)
            for i, ids in zip(chosen, encoded):
                self.attach_tokens(ok[i], ids)
        return rows

    def is_raw(self, values: dict[str, Any]) -> bool:
        """Whether the row's prompt goes to the model as it is (no chat template); an OpenAI Batch completion's."""
        if self.input.format == "openai-batch":
            return values.get("messages") is None
        return not self.input.chat_template

    def attach_tokens(self, row: SourceRow, ids: list[int]) -> None:
        row.prompt_tokens = len(ids)
        if not ids:
            row.error = "prompt is empty after tokenization"
        elif self.task in ("embed", "classify"):  # the engine cuts a prompt longer than the model's maximum length
            row.token_ids = ids                  # (or refuses it: truncate false)
        elif self.task == "score" and self.max_model_len is not None and len(ids) > self.max_model_len:
            row.error = f"prompt is too long: {len(ids)} tokens, and {self.context_limit}"
        elif self.task != "score" and self.max_model_len is not None and len(ids) >= self.max_model_len:
            row.error = f"prompt is too long: {len(ids)} tokens, and {self.context_limit} (at least one must be " \
                        f"left to generate)"
        else:
            row.token_ids = ids
        if row.error:
            row.sampling = None

    def checked_size(self, prompt: PromptText) -> PromptText:
        """The prompt, unless it has more characters than its context could hold in tokens: then that row's error,
        before the tokenizer sees it (a 10 MB prompt's tokens alone take far more memory than the run's bound).
        embed and classify truncate instead: the text is cut to what the maximum length could hold, and the engine
        cuts its tokens."""
        limit = self.char_limit
        if limit is not None and len(prompt.text) > limit and self.truncates:
            # (a prompt with special-token text from the data stands in for it: user_text cut that text already)
            return PromptText(prompt.text[:limit]) if prompt.stand_in is None else prompt
        if limit is not None and len(prompt.text) > limit:
            raise RowError(f"prompt is {len(prompt.text):,} characters, more than the context of "
                           f"{self.max_model_len:,} tokens could hold (at most {MAX_CHARS_PER_TOKEN} characters a "
                           f"token); it was not tokenized")
        return prompt

    @property
    def char_limit(self) -> int | None:
        return None if self.max_model_len is None else self.max_model_len * MAX_CHARS_PER_TOKEN

    @property
    def truncates(self) -> bool:
        """Whether a prompt longer than the model's maximum length is cut (embed and classify, unless truncate is
        false) rather than refused."""
        return self.task in ("embed", "classify") and self.task_section.truncate

    def prompt_text(self, values: dict[str, Any]) -> PromptText:
        if self.is_raw(values):
            return self.encoder.raw(self.user_text(values))
        messages = self.messages(values)
        try:
            return self.encoder.chat(messages)
        except SpecialTokenError:
            raise
        except Exception as exc:  # the template's own checks (e.g. roles must alternate)
            raise RowError(f"chat template failed: {_first_line(exc)}") from None

    def messages(self, values: dict[str, Any]) -> list[dict[str, str]]:
        """The row's conversation: its messages or user turn, after the system message if there is one."""
        cfg = self.input
        if cfg.format == "openai-batch":
            messages = check_messages(values["messages"], "messages")
        elif cfg.messages_column:
            messages = check_messages(values[cfg.messages_column], cfg.messages_column)
        else:
            messages = [{"role": "user", "content": self.user_text(values)}]
        system = cfg.system_prompt
        if cfg.system_column:
            system = values[cfg.system_column]
            if system is not None and not isinstance(system, str):
                raise RowError(f"column {cfg.system_column!r} must be a string, got {type(system).__name__}")
        if system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}] + messages
        return messages

    def user_text(self, values: dict[str, Any]) -> str:
        cfg = self.input
        if cfg.template is not None:
            prompt = render_template(cfg.template, values)
        else:
            prompt = values[cfg.prompt_column]
            if prompt is None:
                raise RowError(f"prompt is null (column {cfg.prompt_column!r})")
            if not isinstance(prompt, str):
                raise RowError(f"prompt must be a string, got {type(prompt).__name__} "
                               f"(column {cfg.prompt_column!r})")
        if not prompt.strip():
            raise RowError("prompt is empty")
        if self.truncates and self.char_limit is not None and len(prompt) > self.char_limit:
            return prompt[:self.char_limit]  # what the maximum length could hold: a 10 MB row costs nothing
        return prompt

    def row_lora(self, values: dict[str, Any]) -> str | None:
        """The row's adapter: its lora column's name, or the job's lora_default where it names none (null or "")."""
        name = values.get(self.lora_column) if self.lora_column else None
        if name is None or name == "":
            return self.lora_default
        if self.input.format == "openai-batch":  # a body's `model`: an adapter's name, or else the job's model
            return name if name in self.adapters else self.lora_default
        if not isinstance(name, str):
            raise RowError(f"lora adapter name must be a string, got {type(name).__name__} (column "
                           f"{self.lora_column!r})")
        if name not in self.adapters:
            raise RowError(f"lora adapter {name!r} is not one of the job's (lora: {', '.join(self.adapters)}; "
                           f"column {self.lora_column!r})")
        return name

    def row_sampling(self, values: dict[str, Any]) -> SamplingParams:
        """The row's sampling: the job's, with the row's non-null values of the per-row columns. A row's constraint
        (choice, regex, json_schema or grammar) replaces the job's, whichever it is."""
        overrides = {}
        for key in self.row_sampling_keys:
            value = values.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)) or value == []:
                continue  # null (or an empty choice list): the job's value
            if key in ROW_INTEGER_KEYS and isinstance(value, float) and value.is_integer():
                value = int(value)
            overrides[key] = value
        if not overrides:
            return self.default_params
        if any(key in overrides for key in CONSTRAINT_KEYS):
            overrides = {**{key: [] if key == "choice" else None for key in CONSTRAINT_KEYS}, **overrides}
        params = self.sampling.params(**overrides)
        try:
            params.validate()
        except ValueError as exc:
            raise RowError(f"invalid per-row sampling value: {exc}") from None
        return params


def check_messages(messages: Any, column: str) -> list[dict[str, str]]:
    """The conversation as a list of {role, content}, every role one of MESSAGE_ROLES."""
    if messages is None:
        raise RowError(f"messages are null (column {column!r})")
    if not isinstance(messages, list) or not messages:
        raise RowError(f"column {column!r} must hold a non-empty list of {{role, content}} messages")
    checked = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise RowError(f"column {column!r}: each message needs a string role and content, got {message!r}")
        if message["role"] not in MESSAGE_ROLES:
            raise RowError(f"column {column!r}: unknown role {message['role']!r} "
                           f"(allowed: {', '.join(MESSAGE_ROLES)})")
        checked.append({"role": message["role"], "content": message["content"]})
    if not any(m["content"].strip() for m in checked):
        raise RowError("prompt is empty")
    return checked


def sort_windows(rows: Iterable[SourceRow], window: int, how: str) -> Iterator[SourceRow]:
    """Sort each run of `window` rows: `prefix` by token ids (rows sharing a prefix become neighbours),
    `length` by prompt length (shortest first), `none` keeps input order. Error rows lead their window."""
    if how == "none":
        yield from rows
        return
    # An adapter's rows together: the prefix cache shares KV within one adapter only, and a step holds at most
    # max_loras adapters. Rows without one (the base model), and error rows, come first.
    # (Rows of other kinds, a bench's, may have no adapter at all.)
    if how == "prefix":
        key = lambda r: (getattr(r, "lora", None) or "", r.token_ids or [])  # noqa: E731
    else:
        key = lambda r: (getattr(r, "lora", None) or "", len(r.token_ids or ()))  # noqa: E731
    pending: list[SourceRow] = []
    for row in rows:
        pending.append(row)
        if len(pending) >= window:
            pending.sort(key=key)
            yield from pending
            pending = []
    pending.sort(key=key)
    yield from pending
