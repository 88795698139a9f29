"""output.parse_json: each row's text parsed as JSON into the `json` column, whose Arrow type is derived from
sampling.json_schema. The engine only makes the text follow the schema; reading it back is the sink's.

The mapping (README, "The output"): object -> struct of its properties in order; string -> string; integer -> int64;
number -> float64; boolean -> bool; array -> list of its items' type; an enum (or const) of strings -> string; a
`type` list of one type and "null" -> that type. Anything else (anyOf, oneOf, allOf, $ref, an enum of other
values, no type, an object without properties or with additionalProperties, ...) -> the value's JSON text, as a
string, so that no value is lost to a type that cannot hold it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.engine.request import Result

# The kinds of JsonType; TEXT is a value kept as its JSON text.
OBJECT, ARRAY, STRING, INTEGER, NUMBER, BOOLEAN, TEXT = "object", "array", "string", "integer", "number", \
    "boolean", "text"
SCALARS = {STRING: pa.string(), INTEGER: pa.int64(), NUMBER: pa.float64(), BOOLEAN: pa.bool_()}
# Keywords whose meaning a single Arrow type cannot hold: a schema using one is kept as text.
COMPOSITE_KEYWORDS = ("$ref", "anyOf", "oneOf", "allOf", "not", "if", "prefixItems", "patternProperties")
INT64 = (-2**63, 2**63 - 1)

LENGTH_ERROR = "max_tokens reached before the JSON closed"


@dataclass(frozen=True)
class JsonType:
    """What one node of a JSON schema becomes in the output."""

    kind: str
    nullable: bool = False  # the schema's type list admits null
    fields: tuple[tuple[str, JsonType], ...] = ()  # OBJECT: its properties, in order
    items: JsonType | None = None  # ARRAY
    enum: tuple[str, ...] | None = None  # STRING: the allowed values, when the schema lists them

    @property
    def arrow(self) -> pa.DataType:
        if self.kind == OBJECT:
            return pa.struct([(name, field.arrow) for name, field in self.fields])
        if self.kind == ARRAY:
            return pa.list_(self.items.arrow)
        return SCALARS.get(self.kind, pa.string())


def json_type(schema: Any) -> JsonType:
    """The output type of a JSON schema (a parsed one: dicts and lists)."""
    if not isinstance(schema, dict) or any(keyword in schema for keyword in COMPOSITE_KEYWORDS):
        return JsonType(TEXT)
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if isinstance(values, list) and values and all(isinstance(value, str) for value in values):
            return JsonType(STRING, enum=tuple(values))
        return JsonType(TEXT)
    kind, nullable = schema.get("type"), False
    if isinstance(kind, list):
        others = [k for k in kind if k != "null"]
        kind, nullable = (others[0], len(others) < len(kind)) if len(others) == 1 else (None, False)
    if kind in SCALARS:
        return JsonType(kind, nullable)
    if kind == ARRAY:
        return JsonType(ARRAY, nullable, items=json_type(schema.get("items", True)))
    if kind == OBJECT:
        properties = schema.get("properties")
        closed = schema.get("additionalProperties", False) is False
        if isinstance(properties, dict) and properties and closed:
            return JsonType(OBJECT, nullable, fields=tuple((name, json_type(sub)) for name, sub in properties.items()))
    return JsonType(TEXT)


def schema_json_type(schema_text: str) -> JsonType:
    """The output type of sampling.json_schema's text (checked to be JSON when the job was read)."""
    return json_type(json.loads(schema_text))


class Misfit(ValueError):
    """A parsed value that does not have the type its schema gives it."""


def parse_json_output(result: Result, json_type: JsonType) -> tuple[Any, str | None]:
    """(the `json` value, the error to report) of one row. An error row has neither; a row cut by max_tokens
    (finish_reason `length`) has no value and LENGTH_ERROR; a text that is not JSON, or JSON of another type than
    the schema's, has no value and says why."""
    if result.finish_reason == "error":
        return None, None
    if result.finish_reason == "length":
        return None, LENGTH_ERROR
    try:
        value = json.loads(result.text)
    except (ValueError, RecursionError) as exc:
        return None, f"the text is not JSON: {exc}"
    try:
        return convert(value, json_type, "$"), None
    except (Misfit, RecursionError) as exc:
        return None, f"the JSON does not fit sampling.json_schema: {exc}"


def convert(value: Any, t: JsonType, path: str) -> Any:
    """`value` (from json.loads) as the Python value of the Arrow type t.arrow, or Misfit naming where it is."""
    if t.kind == TEXT:
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        if t.nullable:
            return None
        raise Misfit(f"{path} is null, the schema wants {_a(t.kind)}")
    if t.kind == OBJECT:
        if not isinstance(value, dict):
            raise Misfit(f"{path} is {_describe(value)}, the schema wants an object")
        names = {name for name, _ in t.fields}
        extra = next((key for key in value if key not in names), None)
        if extra is not None:
            raise Misfit(f"{path} has the key {extra!r}, which the schema does not list")
        return {name: convert(value[name], field, f"{path}.{name}") if name in value else None
                for name, field in t.fields}
    if t.kind == ARRAY:
        if not isinstance(value, list):
            raise Misfit(f"{path} is {_describe(value)}, the schema wants an array")
        return [convert(item, t.items, f"{path}[{i}]") for i, item in enumerate(value)]
    if t.kind == STRING and isinstance(value, str):
        if t.enum is not None and value not in t.enum:
            raise Misfit(f"{path} is {value!r}, not one of the schema's values")
        return value
    if t.kind == INTEGER and _is_number(value) and (isinstance(value, int) or value.is_integer()):
        if not INT64[0] <= value <= INT64[1]:  # compared before int(): int(1e308) is exact but huge
            raise Misfit(f"{path} is {value}, outside int64")
        return int(value)
    if t.kind == NUMBER and _is_number(value):
        try:
            return float(value)
        except OverflowError:
            raise Misfit(f"{path} is {value}, outside float64") from None
    if t.kind == BOOLEAN and isinstance(value, bool):
        return value
    raise Misfit(f"{path} is {_describe(value)}, the schema wants {_a(t.kind)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _a(kind: str) -> str:
    return {INTEGER: "an integer", ARRAY: "an array", OBJECT: "an object"}.get(kind, f"a {kind}")


def _describe(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "an array"
    return json.dumps(value)[:60]
