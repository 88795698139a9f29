"""input.template: the columns a prompt template reads and the format spec of each, checked against the input's
column types. A leaf below config.py and input/files.py."""
from __future__ import annotations

import string
from typing import Any

import pyarrow as pa

from .keys import JobConfigError


def template_columns(template: str) -> list[str]:
    """The column names a template like "Summarize:\\n{text}" reads, in order of first use."""
    return list(dict.fromkeys(column for column, _ in template_fields(template)))


def template_fields(template: str) -> list[tuple[str, str]]:
    """(column, format spec) of each field of a template. A field is a column name with an optional format spec
    ({text}, {score:.2f}): indexing, attributes and conversions would raise on one row's value, or expose Python
    objects, so they are refused here."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise JobConfigError(f"input.template: {exc} (write literal braces as {{{{ and }}}})") from None
    fields = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name or name.isdigit():
            raise JobConfigError("input.template: name a column inside each pair of braces, e.g. {text}")
        if conversion or "{" in spec or any(mark in name for mark in ".["):
            written = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise JobConfigError(f"input.template: {written} is not allowed; a field is a column name with an "
                                 f"optional format spec, e.g. {{text}} or {{score:.2f}} (no indexing, attributes, "
                                 f"conversions or nested fields)")
        fields.append((name, spec))
    if not fields:
        raise JobConfigError("input.template: reads no column; name one in braces, e.g. {text}")
    return fields


def check_template_specs(template: str, types: dict[str, pa.DataType]) -> None:
    """A format spec must suit its column's type: {name:.2f} over a string column would fail on every row."""
    for column, spec in template_fields(template):
        sample = _sample_value(types[column])
        if not spec or sample is None:
            continue
        try:
            format(sample, spec)
        except (ValueError, TypeError) as exc:
            raise JobConfigError(f"input.template: {{{column}:{spec}}} does not suit column {column!r} "
                                 f"({types[column]}): {exc}") from None


def _sample_value(arrow_type: pa.DataType) -> Any:
    """A value of the Python type that column values of `arrow_type` take, or None when not checked."""
    for is_type, sample in ((pa.types.is_boolean, False), (pa.types.is_integer, 0), (pa.types.is_floating, 0.0),
                            (pa.types.is_string, ""), (pa.types.is_large_string, "")):
        if is_type(arrow_type):
            return sample
    return None  # other types: a spec that does not suit a value fails that row
