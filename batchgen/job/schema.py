"""The output columns, defined once: name, Arrow type, how the value is read from a Result, and the meaning the
README's output table shows (tests/test_output_schema.py keeps that table equal to this one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa

from batchgen.engine.request import Result

TIMESTAMP = pa.timestamp("us", tz="UTC")

# The id's type when input.id_column is not set: the row's position in the input.
ROW_POSITION_ID_TYPE = pa.int64()

# The internal column of in-progress part files: the row's position in the input (the resume ledger).
ROW_COLUMN = "_row"


@dataclass(frozen=True)
class OutputColumn:
    name: str
    type: pa.DataType | None  # None: the type of input.id_column (ROW_POSITION_ID_TYPE without one)
    nullable: bool  # documentation only: every Arrow field stays nullable, so the files do not change
    meaning: str
    read: Callable[[Result], Any] | None = None  # default: the Result attribute of the same name

    def value(self, result: Result) -> Any:
        value = self.read(result) if self.read else getattr(result, self.name)
        if self.type is not None and pa.types.is_timestamp(self.type) and value is not None:
            return int(round(value * 1_000_000))  # epoch seconds -> microseconds
        return value

    @property
    def type_text(self) -> str:
        """The type as the README writes it."""
        if self.type is None:
            text = f"as `input.id_column` ({type_text(ROW_POSITION_ID_TYPE)} for row positions)"
        else:
            text = type_text(self.type)
        return f"{text}, null" if self.nullable else text


def type_text(arrow_type: pa.DataType) -> str:
    if pa.types.is_timestamp(arrow_type):
        return f"timestamp[{arrow_type.unit}, {arrow_type.tz}]"
    return "float64" if arrow_type == pa.float64() else str(arrow_type)


# The fixed output columns, in order; output.keep_columns follow them. The id comes from the input row, every
# other column from the row's Result.
COLUMNS = (
    OutputColumn("id", None, False, "the row's id"),
    OutputColumn("text", pa.string(), False, "the generated text (empty for an error row)"),
    OutputColumn("finish_reason", pa.string(), False, "`stop` (end of sequence or a stop string), `length` "
                 "(`max_tokens` or the context) or `error`"),
    OutputColumn("error", pa.string(), True, "why the row failed; null unless `finish_reason` is `error`"),
    OutputColumn("prompt_tokens", pa.int64(), False, "prompt length in tokens (for a too-long prompt: its length)"),
    OutputColumn("output_tokens", pa.int64(), False, "generated tokens"),
    OutputColumn("cached_tokens", pa.int64(), False, "prompt tokens served from the prefix cache"),
    OutputColumn("queue_s", pa.float64(), True, "arrival → first scheduled"),
    OutputColumn("ttft_s", pa.float64(), True, "arrival → first token"),
    OutputColumn("tpot_s", pa.float64(), True,
                 "mean seconds per output token after the first; null with fewer than 2 tokens"),
    OutputColumn("e2e_s", pa.float64(), False, "arrival → finish"),
    OutputColumn("arrival_time", TIMESTAMP, False, "when the engine took the row"),
    OutputColumn("first_token_time", TIMESTAMP, True, "first token"),
    OutputColumn("finish_time", TIMESTAMP, False, "finish"),
    OutputColumn("num_preemptions", pa.int64(), False,
                 "times the row was preempted (recomputed, nothing lost or repeated)"),
)
ID_COLUMN, RESULT_COLUMNS = COLUMNS[0], COLUMNS[1:]
OUTPUT_COLUMNS = tuple(column.name for column in COLUMNS)

# The README table's last row: the input columns copied after the fixed ones.
KEEP_COLUMNS_ROW = ("*keep_columns*", "as in the input", "copied from the input row")


def output_schema(id_type: pa.DataType, keep: list[tuple[str, pa.DataType]]) -> pa.Schema:
    """The output columns; the id and the kept input columns take their input type in its portable form."""
    fields = [(column.name, portable_type(id_type) if column.type is None else column.type) for column in COLUMNS]
    return pa.schema(fields + [(name, portable_type(arrow_type)) for name, arrow_type in keep])


def portable_type(arrow_type: pa.DataType) -> pa.DataType:
    """One type for the values of an input column whatever encoding its writer chose: large_string, string_view
    and a dictionary of strings are `string`, large_binary `binary`, large_list `list` (nested types likewise).
    The same rows rewritten by another tool (polars writes large_string) then keep the same output schema."""
    t = arrow_type
    if pa.types.is_dictionary(t):
        return portable_type(t.value_type)
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_portable_field(t.value_field), t.list_size)
    if any(is_list(t) for is_list in (pa.types.is_list, pa.types.is_large_list, pa.types.is_list_view,
                                      pa.types.is_large_list_view)):
        return pa.list_(_portable_field(t.value_field))
    if pa.types.is_map(t):
        return pa.map_(_portable_field(t.key_field), _portable_field(t.item_field), t.keys_sorted)
    if pa.types.is_struct(t):
        return pa.struct([_portable_field(t.field(i)) for i in range(t.num_fields)])
    return t


def _portable_field(field: pa.Field) -> pa.Field:
    return field.with_type(portable_type(field.type))


def markdown_rows() -> list[str]:
    """The README's output table, as it should read."""
    rows = [(f"`{c.name}`", c.type_text, c.meaning) for c in COLUMNS] + [KEEP_COLUMNS_ROW]
    return ["| column | type | meaning |", "|---|---|---|"] + [f"| {' | '.join(row)} |" for row in rows]
