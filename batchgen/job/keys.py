"""Reading the job file's keys: plain YAML values checked and converted by type, every error naming its key."""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Iterator, Literal, Union


class JobConfigError(ValueError):
    """A problem with the job itself (its file, keys, values, input or output location), found before the
    model loads. The message is one line and names the key, file or column."""


class OutputBusy(JobConfigError):
    """Another run is writing the output (it holds the local lock or a live lease): not a problem with the job,
    so the command exits 75 (EX_TEMPFAIL), retry later, rather than 2."""


# Bounds on a job's values as they would be written out. YAML aliases repeat what they refer to: a few hundred
# bytes of chained aliases expand to billions of items once written as JSON (sampling.json_schema) or walked;
# and a structure nested hundreds deep overflows the recursion of every reader after this one.
MAX_JOB_ITEMS = 1_000_000  # values, keys and list items, counted as often as aliases repeat them
MAX_JOB_TEXT = 64 * 2**20  # characters of strings, counted the same way
MAX_JOB_DEPTH = 64  # mappings and lists inside one another, the job's own sections included


def check_bounded(raw: Any) -> None:
    """Refuse a job whose values, expanded as a JSON writer would expand them, are larger or deeper than the
    bounds above, naming the key where the bound was crossed. The walk stops at the bound, so its own time and
    memory are bounded too, whatever the aliases multiply to (a self-referencing alias is infinitely deep)."""
    items = text = 0
    stack: list[Iterator[tuple[str, Any]]] = [iter([("", raw)])]  # one iterator of (key, value) per open level
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
            continue
        key, value = entry
        items += 1
        text += len(value) if isinstance(value, str) else 0
        where = job_key(key)
        if items > MAX_JOB_ITEMS or text > MAX_JOB_TEXT:
            raise JobConfigError(f"{where}: the job's values expand to more than {MAX_JOB_ITEMS:,} items or "
                                 f"{MAX_JOB_TEXT // 2**20} MiB of text (YAML aliases repeat what they refer to); "
                                 f"write a large schema to sampling.json_schema_file")
        if not isinstance(value, (dict, list)):
            continue
        if len(stack) > MAX_JOB_DEPTH:
            raise JobConfigError(f"{where}: nested more than {MAX_JOB_DEPTH} levels deep (a YAML alias that "
                                 f"refers to itself, or a structure too deep to be a job's value)")
        stack.append(_children(key, value))


def job_key(path: str) -> str:
    """The job key a value's path lies under (sampling.json_schema for sampling.json_schema.enum[3][0])."""
    return ".".join(path.split("[")[0].split(".")[:2]) or "the job file"


def _children(key: str, value: dict | list) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        return ((f"{key}.{name}" if key else str(name), child) for name, child in value.items())
    return ((f"{key}[{i}]", child) for i, child in enumerate(value))


def keys_of(cls: type, skip: tuple[str, ...] = ()) -> dict[str, tuple[Any, bool]]:
    """A dataclass's fields as job keys: name -> (type, required)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls) if f.name not in skip}


def read_keys(keys: dict[str, tuple[Any, bool]], raw: Any, prefix: str) -> dict[str, Any]:
    """Check and convert one mapping of the job file against `keys` (name -> (type, required)); a missing section
    is read as empty, so that its first missing key is the one reported."""
    where = prefix.rstrip(".") or "the job file"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobConfigError(f"{where}: expected a mapping of keys, got {_describe(raw)}")
    for key in raw:
        if key not in keys:
            near = difflib.get_close_matches(str(key), keys, n=1)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else f" (known keys: {', '.join(keys)})"
            raise JobConfigError(f"unknown key {prefix}{key}{hint}")
    values = {}
    for name, (hint, required) in keys.items():
        key = prefix + name
        if isinstance(hint, dict):
            values[name] = read_keys(hint, raw.get(name), key + ".")
        elif dataclasses.is_dataclass(hint):
            values[name] = hint(**read_keys(keys_of(hint), raw.get(name), key + "."))
        elif name in raw:
            values[name] = _convert(raw[name], hint, key)
        elif required:
            raise JobConfigError(f"missing key {key}")
    return values


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
    if dataclasses.is_dataclass(hint):  # a mapping of its fields (engine.speculative)
        return hint(**read_keys(keys_of(hint), value, key + "."))
    if origin is Literal:
        if value not in args:
            raise JobConfigError(f"{key}: expected one of {' | '.join(map(str, args))}, got {_describe(value)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise JobConfigError(f"{key}: expected a mapping, got {_describe(value)}")
        return {_convert(name, args[0], key): _convert(item, args[1], f"{key}.{name}") for name, item in value.items()}
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
            # unquoted, YAML reads yes, no, on, off, true, false as booleans and 1, 2.5 as numbers
            hint = " (quote it to make it text)" if isinstance(value, (bool, int, float)) else ""
            raise JobConfigError(f"{key}: expected a string, got {_describe(value)}{hint}")
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


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
