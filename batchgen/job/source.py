"""The input side of a job: find the Parquet files, check their columns, stream rows in record batches, build
each row's prompt, tokenize it, and sort within a window so rows sharing a prefix reach the engine together.

A row whose prompt or per-row values are unusable comes out as a SourceRow with `error` set and no tokens;
it never reaches the engine."""
from __future__ import annotations

import glob
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.engine.request import SamplingParams

from .config import ROW_SAMPLING_KEYS, JobConfig, JobConfigError, template_columns


class Tokenizer(Protocol):
    """What the source needs of a Hugging Face tokenizer."""

    def __call__(self, texts: list[str], add_special_tokens: bool) -> Any: ...  # -> {"input_ids": [[int]]}

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str: ...


@dataclass(frozen=True)
class InputFiles:
    """The job's input as found on disk, checked against the job before anything is read."""

    files: tuple[Path, ...]
    row_counts: tuple[int, ...]
    column_types: dict[str, pa.DataType]  # every column of any file (types agree where the job reads them)

    @property
    def total_rows(self) -> int:
        return sum(self.row_counts)


@dataclass(slots=True)
class SourceRow:
    row: int  # position in the input, across files in sorted file order
    id: Any
    keep: tuple  # values of output.keep_columns
    token_ids: list[int] | None  # None when the row is an error
    sampling: SamplingParams | None
    error: str | None = None
    prompt_tokens: int = 0


class RowError(ValueError):
    """Why one row cannot be generated; becomes that row's `error`."""


# -- finding and checking the input -------------------------------------------------------------------------------

def find_input_files(path: str) -> list[Path]:
    """A file, a directory (its *.parquet files, recursively, skipping hidden and _-prefixed names as pyarrow
    does) or a glob; sorted by path."""
    root = Path(path).expanduser()
    if root.is_file():
        return [root]
    if root.is_dir():
        files = [p for p in root.rglob("*.parquet") if p.is_file() and not _hidden(p.relative_to(root))]
    elif glob.has_magic(path):
        files = [Path(p) for p in glob.glob(str(root), recursive=True) if Path(p).is_file()]
    else:
        raise JobConfigError(f"input.path: no such file or directory: {path}")
    if not files:
        raise JobConfigError(f"input.path: no Parquet files found at {path}")
    return sorted(files, key=str)


def _hidden(relative: Path) -> bool:
    return any(part.startswith((".", "_")) for part in relative.parts)


def inspect_input(config: JobConfig) -> InputFiles:
    """Open every file's footer and check that the columns the job names exist, with one type across files."""
    files = find_input_files(config.input.path)
    row_counts, types, seen_in = [], {}, {}
    read = {column for _, column in required_columns(config)} | set(ROW_SAMPLING_KEYS)
    for path in files:
        try:
            meta = pq.ParquetFile(path)
            schema = meta.schema_arrow
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise JobConfigError(f"input.path: {path} is not a readable Parquet file ({_first_line(exc)})") from None
        row_counts.append(meta.metadata.num_rows)
        for key, column in required_columns(config):
            if column not in schema.names:
                raise JobConfigError(f"{key}: column {column!r} not found in {path} "
                                     f"(columns: {', '.join(schema.names)})")
        for fld in schema:
            known = types.get(fld.name)
            if known is None or pa.types.is_null(known):
                types[fld.name], seen_in[fld.name] = fld.type, path
            elif not pa.types.is_null(fld.type) and fld.type != known and fld.name in read:
                raise JobConfigError(f"input.path: column {fld.name!r} is {known} in {seen_in[fld.name]} "
                                     f"but {fld.type} in {path}")
    return InputFiles(tuple(files), tuple(row_counts), types)


def required_columns(config: JobConfig) -> list[tuple[str, str]]:
    """(job key, column) for every column the job needs in every input file."""
    cfg = config.input
    needed = []
    if cfg.messages_column:
        needed.append(("input.messages_column", cfg.messages_column))
    elif cfg.template is not None:
        needed += [("input.template", column) for column in template_columns(cfg.template)]
    else:
        needed.append(("input.prompt_column", cfg.prompt_column))
    if cfg.system_column:
        needed.append(("input.system_column", cfg.system_column))
    if cfg.id_column:
        needed.append(("input.id_column", cfg.id_column))
    needed += [("output.keep_columns", column) for column in config.output.keep_columns]
    return needed


def read_columns(config: JobConfig, column_types: dict[str, pa.DataType]) -> list[str]:
    """Every column the source reads: the required ones and any per-row sampling overrides."""
    columns = [column for _, column in required_columns(config)]
    columns += [key for key in ROW_SAMPLING_KEYS if key in column_types]
    return list(dict.fromkeys(columns))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- reading, prompt building, tokenizing, sorting ---------------------------------------------------------------

def read_source(config: JobConfig, inputs: InputFiles, tokenizer: Tokenizer, max_model_len: int | None,
                done: bytearray | None = None) -> Iterator[SourceRow]:
    """Stream the job's rows, skipping those marked in `done`, sorted within windows of `input.sort_window`."""
    builder = PromptBuilder(config, inputs, tokenizer, max_model_len)
    built = (row for batch in read_batches(config, inputs, done) for row in builder.build(batch))
    return sort_windows(built, config.input.sort_window, config.input.sort)


def read_batches(config: JobConfig, inputs: InputFiles,
                 done: bytearray | None = None) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    """Record batches as lists of (row position, {column: value}), rows in `done` left out."""
    columns = read_columns(config, inputs.column_types)
    first_row = 0
    for path, count in zip(inputs.files, inputs.row_counts):
        if done is not None and all(done[first_row:first_row + count]):
            first_row += count
            continue
        parquet = pq.ParquetFile(path)
        present = [c for c in columns if c in parquet.schema_arrow.names]
        position = first_row
        for batch in parquet.iter_batches(batch_size=config.input.read_batch_rows, columns=present):
            values = batch.to_pydict()
            rows = []
            for i in range(batch.num_rows):
                if done is None or not done[position + i]:
                    rows.append((position + i, {c: values[c][i] for c in present}))
            position += batch.num_rows
            if rows:
                yield rows
        first_row += count


class PromptBuilder:
    """Turns input rows into SourceRows: prompt text (template / system / chat template), token ids and the
    row's sampling parameters, or an error."""

    def __init__(self, config: JobConfig, inputs: InputFiles, tokenizer: Tokenizer, max_model_len: int | None):
        self.input = config.input
        self.sampling = config.sampling
        self.keep_columns = config.output.keep_columns
        self.row_sampling_keys = [k for k in ROW_SAMPLING_KEYS if k in inputs.column_types]
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # Rows without overrides share one params object (validated with the job); nothing mutates it.
        self.default_params = self.sampling.params()

    def build(self, batch: list[tuple[int, dict[str, Any]]]) -> list[SourceRow]:
        rows, texts = [], []
        for position, values in batch:
            ident = values[self.input.id_column] if self.input.id_column else position
            keep = tuple(values[c] for c in self.keep_columns)
            try:
                sampling = self.row_sampling(values)
                texts.append(self.prompt_text(values))
                rows.append(SourceRow(position, ident, keep, None, sampling))
            except RowError as exc:
                rows.append(SourceRow(position, ident, keep, None, None, error=str(exc)))
        ok = [row for row in rows if row.error is None]
        if ok:
            encoded = self.tokenizer(texts, add_special_tokens=not self.input.chat_template)["input_ids"]
            for row, ids in zip(ok, encoded):
                self.attach_tokens(row, list(ids))
        return rows

    def attach_tokens(self, row: SourceRow, ids: list[int]) -> None:
        row.prompt_tokens = len(ids)
        if not ids:
            row.error = "prompt is empty after tokenization"
        elif self.max_model_len is not None and len(ids) >= self.max_model_len:
            row.error = (f"prompt is too long: {len(ids)} tokens, the model's context is "
                         f"{self.max_model_len} tokens")
        else:
            row.token_ids = ids
        if row.error:
            row.sampling = None

    def prompt_text(self, values: dict[str, Any]) -> str:
        cfg = self.input
        if cfg.messages_column:
            messages = check_messages(values[cfg.messages_column], cfg.messages_column)
        else:
            prompt = self.user_text(values)
            if not cfg.chat_template:
                return prompt
            messages = [{"role": "user", "content": prompt}]
        system = cfg.system_prompt
        if cfg.system_column:
            system = values[cfg.system_column]
            if system is not None and not isinstance(system, str):
                raise RowError(f"column {cfg.system_column!r} must be a string, got {type(system).__name__}")
        if system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}] + messages
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (e.g. roles must alternate)
            raise RowError(f"chat template failed: {_first_line(exc)}") from None

    def user_text(self, values: dict[str, Any]) -> str:
        cfg = self.input
        if cfg.template is not None:
            for column in template_columns(cfg.template):
                if values[column] is None:
                    raise RowError(f"column {column!r} is null")
            prompt = cfg.template.format_map(values)
        else:
            prompt = values[cfg.prompt_column]
            if prompt is None:
                raise RowError(f"prompt is null (column {cfg.prompt_column!r})")
            if not isinstance(prompt, str):
                raise RowError(f"prompt must be a string, got {type(prompt).__name__} "
                               f"(column {cfg.prompt_column!r})")
        if not prompt.strip():
            raise RowError("prompt is empty")
        return prompt

    def row_sampling(self, values: dict[str, Any]) -> SamplingParams:
        overrides = {}
        for key in self.row_sampling_keys:
            value = values.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue  # null: the job's value
            if key in ("max_tokens", "top_k", "seed") and isinstance(value, float) and value.is_integer():
                value = int(value)
            overrides[key] = value
        if not overrides:
            return self.default_params
        params = self.sampling.params(**overrides)
        try:
            params.validate()
        except ValueError as exc:
            raise RowError(f"invalid per-row sampling value: {exc}") from None
        return params


def check_messages(messages: Any, column: str) -> list[dict[str, str]]:
    if messages is None:
        raise RowError(f"messages are null (column {column!r})")
    if not isinstance(messages, list) or not messages:
        raise RowError(f"column {column!r} must hold a non-empty list of {{role, content}} messages")
    checked = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise RowError(f"column {column!r}: each message needs a string role and content, got {message!r}")
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
    key = (lambda r: r.token_ids or []) if how == "prefix" else (lambda r: len(r.token_ids or ()))
    pending: list[SourceRow] = []
    for row in rows:
        pending.append(row)
        if len(pending) >= window:
            pending.sort(key=key)
            yield from pending
            pending = []
    pending.sort(key=key)
    yield from pending
