"""Reading the job file's keys: plain YAML values checked and converted by type, every error naming its key."""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal, Union


class JobConfigError(ValueError):
    """A problem with the job itself (its file, keys, values, input or output location), found before the
    model loads. The message is one line and names the key, file or column."""


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
