"""job.yaml -> a frozen, validated JobConfig. Every error names the key (or file) it is about."""
from __future__ import annotations

import dataclasses
import difflib
import math
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from batchgen.engine.request import SamplingParams


class JobConfigError(ValueError):
    """A problem with the job itself (its file, keys, values, input or output location), found before the
    model loads. The message is one line and names the key, file or column."""


# Input columns with these names override the job's sampling value for their row.
ROW_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")

# The fixed output columns, in order; keep_columns follow them.
OUTPUT_COLUMNS = (
    "id", "text", "finish_reason", "error", "prompt_tokens", "output_tokens", "cached_tokens",
    "queue_s", "ttft_s", "tpot_s", "e2e_s", "arrival_time", "first_token_time", "finish_time", "num_preemptions",
)

# The internal column of in-progress part files: the row's position in the input (the resume ledger).
ROW_COLUMN = "_row"


@dataclass(frozen=True)
class InputConfig:
    path: str
    id_column: str | None = None
    prompt_column: str = "prompt"
    messages_column: str | None = None
    system_prompt: str | None = None
    system_column: str | None = None
    template: str | None = None
    chat_template: bool = True
    sort_window: int = 10_000
    read_batch_rows: int = 1024


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False

    def params(self, **overrides: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(overrides)
        values["stop"] = list(values["stop"])
        values["stop_token_ids"] = list(values["stop_token_ids"])
        return SamplingParams(**values)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    kv_cache_memory: Union[str, int, None] = None  # None: 2GiB on the CPU; on CUDA, gpu_memory_utilization decides
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's context window
    sort: Literal["prefix", "length", "none"] = "prefix"


@dataclass(frozen=True)
class OutputConfig:
    path: str
    keep_columns: tuple[str, ...] = ()
    order: Literal["input", "completion"] = "input"
    rows_per_part: int = 1000
    commit_interval_s: float = 60.0


@dataclass(frozen=True)
class JobConfig:
    input: InputConfig
    output: OutputConfig
    model: str = "default"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (tuples become lists)."""
        return _plain(dataclasses.asdict(self))


def load_job(path: str | Path, overrides: typing.Sequence[str] = ()) -> JobConfig:
    """Read a job file, apply `--set key.path=value` overrides and validate."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise JobConfigError(f"job file not found: {path}") from None
    except OSError as exc:
        raise JobConfigError(f"cannot read job file {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise JobConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobConfigError(f"{path}: the job file must be a mapping of keys, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    return parse_job(raw)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `a.b=value` to the raw mapping; the value is parsed as a YAML scalar (64 -> int, null -> None)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise JobConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. engine.max_num_seqs=64")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    if isinstance(value, dict):  # "Be brief: answer" is text, not a mapping; lists ([a, b]) stay lists
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for depth, part in enumerate(parents):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise JobConfigError(f"--set {key}: {'.'.join(parents[:depth + 1])} is not a section")
        node = child
    node[leaf] = value


def parse_job(raw: dict[str, Any]) -> JobConfig:
    config = _build(JobConfig, raw, prefix="")
    _check(config)
    return config


# -- building dataclasses from plain values, type by type ------------------------------------------------------

def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the job file"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobConfigError(f"{where}: expected a mapping of keys, got {_describe(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else f" (known keys: {', '.join(fields)})"
            raise JobConfigError(f"unknown key {prefix}{key}{hint}")
    values = {}
    for name, f in fields.items():
        key = prefix + name
        hint = hints[name]
        if name not in raw:
            if dataclasses.is_dataclass(hint):  # a missing section: report its first missing key
                values[name] = _build(hint, {}, key + ".")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise JobConfigError(f"missing key {key}")
            continue
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name], key + ".")
        else:
            values[name] = _convert(raw[name], hint, key)
    return cls(**values)


def _convert(value: Any, hint: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(value, option, key)
            except JobConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise JobConfigError(f"{key}: expected {names}, got {_describe(value)}")
    if origin is Literal:
        if value not in args:
            raise JobConfigError(f"{key}: expected one of {' | '.join(map(str, args))}, got {_describe(value)}")
        return value
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_convert(item, args[0], f"{key}[{i}]") for i, item in enumerate(items))
    if hint is bool:
        if not isinstance(value, bool):
            raise JobConfigError(f"{key}: expected true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise JobConfigError(f"{key}: expected an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise JobConfigError(f"{key}: expected a number, got {_describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise JobConfigError(f"{key}: expected a string, got {_describe(value)}")
        return value
    raise TypeError(f"unsupported config type {hint!r} for {key}")


def _type_name(hint: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return f"{value!r}"


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- checks across keys ------------------------------------------------------------------------------------------

def _check(config: JobConfig) -> None:
    if not config.model.strip():
        raise JobConfigError("model: must not be empty")
    _check_input(config.input)
    _check_sampling(config.sampling)
    _check_output(config.output)


def _check_input(cfg: InputConfig) -> None:
    if not cfg.path.strip():
        raise JobConfigError("input.path: must not be empty")
    for name in ("id_column", "prompt_column", "messages_column", "system_column"):
        value = getattr(cfg, name)
        if value is not None and not value.strip():
            raise JobConfigError(f"input.{name}: must be a column name, got an empty string")
    if cfg.messages_column and cfg.template is not None:
        raise JobConfigError("input.template: cannot be combined with input.messages_column")
    if cfg.system_prompt is not None and cfg.system_column:
        raise JobConfigError("input.system_column: set input.system_prompt or input.system_column, not both")
    if not cfg.chat_template:
        for name in ("messages_column", "system_prompt", "system_column"):
            if getattr(cfg, name) is not None:
                raise JobConfigError(f"input.{name}: needs input.chat_template: true")
    if cfg.template is not None:
        template_columns(cfg.template)  # raises on a malformed template
    if cfg.sort_window < 1:
        raise JobConfigError("input.sort_window: must be at least 1")
    if cfg.read_batch_rows < 1:
        raise JobConfigError("input.read_batch_rows: must be at least 1")


def template_columns(template: str) -> list[str]:
    """The column names a template like "Summarize:\\n{text}" reads, in order of first use."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise JobConfigError(f"input.template: {exc} (write literal braces as {{{{ and }}}})") from None
    columns = []
    for name in names:
        column = name.split(".")[0].split("[")[0]
        if not column or column.isdigit():
            raise JobConfigError("input.template: name a column inside each pair of braces, e.g. {text}")
        if column not in columns:
            columns.append(column)
    if not columns:
        raise JobConfigError("input.template: reads no column; name one in braces, e.g. {text}")
    return columns


def _check_sampling(cfg: SamplingConfig) -> None:
    try:
        cfg.params().validate()
    except ValueError as exc:
        message = str(exc)
        name = message.split(" ")[0]
        key = f"sampling.{name}" if name in {f.name for f in dataclasses.fields(cfg)} else "sampling"
        raise JobConfigError(f"{key}: {message}") from None


def _check_output(cfg: OutputConfig) -> None:
    if not cfg.path.strip():
        raise JobConfigError("output.path: must not be empty")
    seen = set()
    for column in cfg.keep_columns:
        if column in OUTPUT_COLUMNS or column == ROW_COLUMN:
            raise JobConfigError(f"output.keep_columns: {column!r} clashes with an output column")
        if column in seen:
            raise JobConfigError(f"output.keep_columns: {column!r} is listed twice")
        seen.add(column)
    if cfg.rows_per_part < 1:
        raise JobConfigError("output.rows_per_part: must be at least 1")
    if cfg.commit_interval_s <= 0:
        raise JobConfigError("output.commit_interval_s: must be positive")
