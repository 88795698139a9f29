"""The output columns, defined once: name, Arrow type, how the value is read from a Result, when the column is
there (most always are; some only when the job asks for them), and the meaning the README's output table shows
(tests/test_output_schema.py keeps that table equal to this one, and column_names.py's names equal its own). What
decides the conditional columns is an OutputOptions, which prepare.output_options reads from the job: the table
knows nothing of the job's config."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.engine.request import TASKS, Result

# the names alone live in a leaf (the config reads them); the table's readers find them here too
from .column_names import OUTPUT_COLUMNS, ROW_COLUMN, SAMPLE_COLUMN  # noqa: F401
from .json_output import JsonType

TIMESTAMP = pa.timestamp("us", tz="UTC")

# The id's type when input.id_column is not set: the row's position in the input.
ROW_POSITION_ID_TYPE = pa.int64()


@dataclass(frozen=True)
class OutputOptions:
    """What decides the output columns beyond the fixed ones: the job's task, its sampling and output keys, and which
    per-row sampling columns the input has. The task decides first: a column belongs to some tasks (OutputColumn.tasks);
    generation's own (text, finish_reason, output tokens, first-token timings, the sampling ones) to generate alone."""

    task: str = "generate"  # the job's task (EngineArgs.task)
    token_logprobs: bool = False  # token_logprobs: task score with score.token_logprobs
    samples: bool = False  # sample_index: n > 1 in the job, or an `n` input column
    choice: bool = False  # choice_probs: sampling.choice, or a `choice` input column
    logprobs: bool = False  # logprobs and top_logprobs: sampling.logprobs, or a `logprobs` input column
    json: JsonType | None = None  # the `json` column's type: output.parse_json, from sampling.json_schema
    replica: bool = False  # replica: the run is a Ray run (executor.kind: ray)
    lora: bool = False  # lora: the job has LoRA adapters (a `lora:` map)


@dataclass(frozen=True)
class JobType:
    """A column type that the job decides."""

    text: str  # as the README writes it
    of: Callable[[pa.DataType, OutputOptions], pa.DataType]  # (input.id_column's type, options) -> the type


@dataclass(frozen=True)
class Condition:
    """When a column is in the output (a column without one always is)."""

    applies: Callable[[OutputOptions], bool]
    text: str  # as the README writes it: "with ..."


@dataclass(frozen=True)
class OutputColumn:
    name: str
    type: pa.DataType | JobType
    nullable: bool  # documentation only: every Arrow field stays nullable, so the files do not change
    meaning: str
    read: Callable[[Result], Any] | None = None  # default: the Result attribute of the same name
    only: Condition | None = None
    tasks: tuple[str, ...] = TASKS  # the tasks whose outputs have it

    def value(self, result: Result) -> Any:
        value = self.read(result) if self.read else getattr(result, self.name)
        if isinstance(self.type, pa.DataType) and pa.types.is_timestamp(self.type) and value is not None:
            return int(round(value * 1_000_000))  # epoch seconds -> microseconds
        return value

    def present(self, options: OutputOptions) -> bool:
        return options.task in self.tasks and (self.only is None or self.only.applies(options))

    def arrow_type(self, id_type: pa.DataType, options: OutputOptions) -> pa.DataType:
        return self.type.of(id_type, options) if isinstance(self.type, JobType) else self.type

    @property
    def type_text(self) -> str:
        """The type as the README writes it."""
        text = self.type.text if isinstance(self.type, JobType) else type_text(self.type)
        return f"{text}, null" if self.nullable else text

    @property
    def table_row(self) -> tuple[str, str, str]:
        """The column's row of the README's output table."""
        if self.only:
            meaning = f"{self.meaning} (only {self.only.text})"
        elif self.tasks != TASKS:
            meaning = f"{self.meaning} (only with {' or '.join(f'`task: {task}`' for task in self.tasks)})"
        else:
            meaning = self.meaning
        return f"`{self.name}`", self.type_text, meaning


def type_text(arrow_type: pa.DataType) -> str:
    t = arrow_type
    if pa.types.is_timestamp(t):
        return f"timestamp[{t.unit}, {t.tz}]"
    if pa.types.is_list(t):
        return f"list<{type_text(t.value_type)}>"
    if pa.types.is_struct(t):
        fields = ", ".join(f"{t.field(i).name}: {type_text(t.field(i).type)}" for i in range(t.num_fields))
        return f"struct<{fields}>"
    return "float64" if t == pa.float64() else str(t)


def _choice_probs(result: Result) -> list[dict] | None:
    if result.choice_probs is None:
        return None
    return [{"choice": choice, "prob": prob} for choice, prob in result.choice_probs]


def _top_logprobs(result: Result) -> list[list[dict]] | None:
    if result.top_logprobs is None:
        return None
    return [[{"token": text, "token_id": token_id, "logprob": logprob} for text, token_id, logprob in alternatives]
            for alternatives in result.top_logprobs]


def _logprob_sum(result: Result) -> float | None:
    return None if result.prompt_logprobs is None else math.fsum(result.prompt_logprobs)


def _num_scored_tokens(result: Result) -> int | None:
    return None if result.prompt_logprobs is None else len(result.prompt_logprobs)


def _perplexity(result: Result) -> float | None:
    if not result.prompt_logprobs:
        return None
    return math.exp(-math.fsum(result.prompt_logprobs) / len(result.prompt_logprobs))


ID_TYPE = JobType(f"as `input.id_column` ({type_text(ROW_POSITION_ID_TYPE)} for row positions)",
                  lambda id_type, options: portable_type(id_type))
JSON_TYPE = JobType("from `sampling.json_schema` (see below)", lambda id_type, options: options.json.arrow)
CHOICE_PROBS_TYPE = pa.list_(pa.struct([("choice", pa.string()), ("prob", pa.float64())]))
TOP_LOGPROBS_TYPE = pa.list_(pa.list_(pa.struct([("token", pa.string()), ("token_id", pa.int32()),
                                                 ("logprob", pa.float64())])))
WITH_LOGPROBS = Condition(lambda o: o.logprobs, "with `sampling.logprobs` or a `logprobs` column")
GENERATE = ("generate",)
VECTOR = pa.list_(pa.float32())

# The output columns, in order; output.keep_columns follow them. The id comes from the input row, `json` from the
# row's text (json_output.py), every other column from the row's Result. A column with a condition is in the output
# only when the job asks for it.
COLUMNS = (
    OutputColumn("id", ID_TYPE, False, "the row's id"),
    OutputColumn(SAMPLE_COLUMN, pa.int32(), False, "the sample's number, 0 to n-1: a row gives one output row per "
                 "sample, all with its id; an error row gives one, numbered 0",
                 only=Condition(lambda o: o.samples, "with `sampling.n` above 1 or an `n` column"), tasks=GENERATE),
    OutputColumn("text", pa.string(), False, "the generated text (empty for an error row)", tasks=GENERATE),
    OutputColumn("embedding", VECTOR, True, "the text's embedding (pooled, cut to `embed.dimensions`, normalized "
                 "as `embed:` says); a list, not a fixed-size list: an error row has no vector, and the dimension is "
                 "known only once the model loads (`_SUCCESS` names it); null for an error row", tasks=("embed",)),
    OutputColumn("label", pa.string(), True, "the most probable label's name; null for an error row",
                 tasks=("classify",)),
    OutputColumn("probs", VECTOR, True, "each label's probability in the model's `id2label` order (the labels, "
                 "in order, are in `_SUCCESS`): softmax, or sigmoid for a multi-label or one-output head; null for an "
                 "error row", tasks=("classify",)),
    OutputColumn("score", pa.float64(), True, "a one-output head's raw output (a reward model's score); null for "
                 "a model with more labels and for an error row", tasks=("classify",)),
    OutputColumn("logprob_sum", pa.float64(), True, "the summed logprob of the scored tokens (the whole text after "
                 "its first token, or the `score.continuation_column` text given the prompt); null for an error row",
                 read=_logprob_sum, tasks=("score",)),
    OutputColumn("num_scored_tokens", pa.int64(), True, "how many tokens `logprob_sum` sums; null for an error row",
                 read=_num_scored_tokens, tasks=("score",)),
    OutputColumn("perplexity", pa.float64(), True, "exp(-logprob_sum / num_scored_tokens); null for an error row",
                 read=_perplexity, tasks=("score",)),
    OutputColumn("token_logprobs", VECTOR, True, "each scored token's logprob, in order; null for an error row",
                 read=lambda result: result.prompt_logprobs, tasks=("score",),
                 only=Condition(lambda o: o.token_logprobs, "with `task: score` and `score.token_logprobs`")),
    OutputColumn("finish_reason", pa.string(), False, "`stop` (end of sequence or a stop string), `length` "
                 "(`max_tokens` or the context) or `error`", tasks=GENERATE),
    OutputColumn("error", pa.string(), True, "why the row failed (`finish_reason` is `error`); with "
                 "`output.parse_json`, also why a row's `json` is null (`finish_reason` stays `stop` or `length`); "
                 "null otherwise (for the tasks other than generate, null exactly for the rows that worked)"),
    OutputColumn("prompt_tokens", pa.int64(), False, "prompt length in tokens (for a too-long prompt: its length; "
                 "for a truncated one: what ran, after the cut)"),
    OutputColumn("num_truncated_tokens", pa.int64(), False, "prompt tokens cut to fit the model's maximum length "
                 "(`truncate: true`, the default)", tasks=("embed", "classify")),
    OutputColumn("output_tokens", pa.int64(), False, "generated tokens", tasks=GENERATE),
    OutputColumn("cached_tokens", pa.int64(), False, "prompt tokens served from the prefix cache"),
    OutputColumn("queue_s", pa.float64(), True, "arrival → first scheduled"),
    OutputColumn("ttft_s", pa.float64(), True, "arrival → first token", tasks=GENERATE),
    OutputColumn("tpot_s", pa.float64(), True,
                 "mean seconds per output token after the first; null with fewer than 2 tokens", tasks=GENERATE),
    OutputColumn("e2e_s", pa.float64(), False, "arrival → finish"),
    OutputColumn("arrival_time", TIMESTAMP, False, "when the engine took the row"),
    OutputColumn("first_token_time", TIMESTAMP, True, "first token", tasks=GENERATE),
    OutputColumn("finish_time", TIMESTAMP, False, "finish"),
    OutputColumn("num_preemptions", pa.int64(), False,
                 "times the row was preempted (recomputed, nothing lost or repeated)"),
    OutputColumn("choice_probs", CHOICE_PROBS_TYPE, True, "each candidate of the row's `choice`, in its order, "
                 "with its probability (they sum to 1); `text` is the chosen one; null for an error row or a row "
                 "without choices", read=_choice_probs, tasks=GENERATE,
                 only=Condition(lambda o: o.choice, "with `sampling.choice` or a `choice` column")),
    OutputColumn("logprobs", pa.list_(pa.float64()), True, "each output token's logprob; null for an error row or "
                 "a row without `logprobs`", only=WITH_LOGPROBS,
                 tasks=GENERATE),
    OutputColumn("top_logprobs", TOP_LOGPROBS_TYPE, True, "per output token, the `logprobs` likeliest tokens "
                 "(text, id, logprob); null as `logprobs`", read=_top_logprobs, only=WITH_LOGPROBS,
                 tasks=GENERATE),
    OutputColumn("json", JSON_TYPE, True, "the text parsed as JSON, typed from the schema; null for an error "
                 "row, and when the text was cut by `max_tokens`, is not JSON or does not fit the type (`error` says "
                 "which)", only=Condition(lambda o: o.json is not None, "with `output.parse_json`"),
                 tasks=GENERATE),
    OutputColumn("lora", pa.string(), True, "the LoRA adapter that answered the row, a name of the job's `lora:`; "
                 "null: the base model", only=Condition(lambda o: o.lora, "with a `lora:` map"), tasks=GENERATE),
    OutputColumn("replica", pa.int32(), False, "the engine replica that generated the row, numbered as replicas "
                 "started (a restarted one gets a new number)",
                 only=Condition(lambda o: o.replica, "in Ray runs, `executor.kind: ray`")),
)
ID_COLUMN, RESULT_COLUMNS = COLUMNS[0], COLUMNS[1:]
JSON_COLUMN = next(column for column in COLUMNS if column.name == "json")

# The README table's last row: the input columns copied after the fixed ones.
KEEP_COLUMNS_ROW = ("*keep_columns*", "as in the input", "copied from the input row")


def error_mask(table: pa.Table) -> pa.ChunkedArray:
    """Which rows of an output table are error rows: `finish_reason` error where the table has it (generate: with
    output.parse_json a row that worked may carry an `error`), else a non-null `error` (the other tasks)."""
    if "finish_reason" in table.column_names:
        return pc.equal(table["finish_reason"], "error")
    return pc.is_valid(table["error"])


def output_schema(id_type: pa.DataType, keep: list[tuple[str, pa.DataType]],
                  options: OutputOptions = OutputOptions()) -> pa.Schema:
    """The output columns that `options` asks for; the id and the kept input columns take their input type in its
    portable form."""
    fields = [(column.name, column.arrow_type(id_type, options)) for column in COLUMNS if column.present(options)]
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
    rows = [c.table_row for c in COLUMNS] + [KEEP_COLUMNS_ROW]
    return ["| column | type | meaning |", "|---|---|---|"] + [f"| {' | '.join(row)} |" for row in rows]
