"""The job layer of constrained output, label confidences, logprobs and n samples per row: the job keys and their
errors, per-row overrides, the conditional output columns, the `json` column's type and values, and n > 1 through
the part writer, the ledger, the final rewrite and a resume.

The engine is not involved: a fake `generate` returns each request's n results together (sample_index 0..n-1), as
the engine's step() does, and a byte-level tokenizer stands in for the model's. The JSON schemas, regexes and
grammars are checked by the real xgrammar."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.request import Result
from batchgen.job.executors import local
from batchgen.job.config import JobConfigError, load_job, parse_job
from batchgen.job.input.files import inspect_input
from batchgen.job.output.json_output import LENGTH_ERROR, JsonType, json_type, parse_json_output, schema_json_type
from batchgen.job.output.resume import describe_changes
from batchgen.job.executors.local import stream_rows
from batchgen.job.prepare import PreparedJob, fingerprint_text, job_fingerprint, output_options
from batchgen.job.output.schema import COLUMNS, ROW_COLUMN, output_schema
from batchgen.job.output.final_rewrite import finalize
from batchgen.job.output.part_writer import PartWriter
from batchgen.job.output.output_dir import OutputDir
from batchgen.job.input.source import read_source

SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}, "score": {"type": "integer"}},
          "required": ["label", "score"]}
CONDITIONAL = ["sample_index", "choice_probs", "logprobs", "top_logprobs", "json"]


def job(**sections):
    raw = {"input": {"path": "in.parquet"}, "output": {"path": "out"}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_job(raw)


def error_of(**sections) -> str:
    with pytest.raises(JobConfigError) as info:
        job(**sections)
    return str(info.value)


def write_parquet(path: Path, columns: dict, schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


class ByteTokenizer:
    """Stands in for the model's tokenizer: one token per byte."""

    def __call__(self, texts, add_special_tokens, split_special_tokens=False):
        return {"input_ids": [list(text.encode()) for text in texts]}


# -- job keys -------------------------------------------------------------------------------------------------------

def test_constraint_keys_become_sampling_params():
    params = job(sampling={"choice": ["FILES", "TEXT", "MATH"], "logprobs": 5, "n": 4}).sampling.params()
    assert (params.choice, params.logprobs, params.n, params.regex) == (["FILES", "TEXT", "MATH"], 5, 4, None)
    assert job(sampling={"regex": r"\d{4}-\d{2}-\d{2}"}).sampling.params().constraint == ("regex", r"\d{4}-\d{2}-\d{2}")
    grammar = 'root ::= "yes" | "no"'
    assert job(sampling={"grammar": grammar}).sampling.params().constraint == ("grammar", grammar)


def test_inline_json_schema_mapping_becomes_json_text_in_key_order():
    schema = {"type": "object", "properties": {"zebra": {"type": "string"}, "apple": {"type": "integer"}}}
    config = job(sampling={"json_schema": schema})
    assert config.sampling.json_schema == '{"type": "object", "properties": {"zebra": {"type": "string"}, ' \
                                          '"apple": {"type": "integer"}}}'
    assert list(json.loads(config.sampling.json_schema)["properties"]) == ["zebra", "apple"]  # not sorted
    text = '{"type": "string"}'
    assert job(sampling={"json_schema": text}).sampling.json_schema == text  # JSON text is kept as written
    assert config.to_dict()["sampling"]["json_schema"] == config.sampling.json_schema


@pytest.mark.parametrize("sampling, message", [
    ({"regex": "(\\d"}, "sampling.regex: regex does not compile: Regex parsing error at position 4"),
    ({"grammar": "root ::= "}, "sampling.grammar: grammar does not compile: EBNF parser error"),
    ({"json_schema": "{type: object}"}, "sampling.json_schema: json_schema is not valid JSON"),
    ({"json_schema": [1, 2]}, "sampling.json_schema: json_schema must be a JSON object (a schema), got list"),
    ({"json_schema": {"type": "nonsense"}}, 'sampling.json_schema: json_schema is not a JSON schema: at $.type: '),
    ({"json_schema": {"type": "string", "default": datetime.date(2024, 1, 1)}},
     "sampling.json_schema: cannot be written as JSON: Object of type date is not JSON serializable (quote"),
    ({"json_schema": 5}, "sampling.json_schema: expected a string, got 5"),
    ({"choice": ["A", "B"], "regex": "a+"}, "sampling.regex: set at most one of choice, regex, json_schema, "
                                            "grammar; got choice and regex"),
    ({"json_schema": SCHEMA, "grammar": 'root ::= "x"'}, "sampling.grammar: set at most one of"),
    ({"choice": ["A", "A"]}, "sampling.choice: choice lists a string twice"),
    ({"choice": ["A", ""]}, "sampling.choice: choice must be a list of non-empty strings"),
    ({"choice": [1]}, "sampling.choice[0]: expected a string, got 1 (quote it to make it text)"),
    ({"regex": "  "}, "sampling.regex: regex must be a non-empty string"),
    ({"n": 0}, "sampling.n: n must be in [1, 128], got 0"),
    ({"n": 1.5}, "sampling.n: expected an integer, got 1.5"),
    ({"logprobs": 21}, "sampling.logprobs: logprobs must be in [0, 20], got 21"),
    ({"logprobs": "many"}, "sampling.logprobs: expected an integer, got 'many'"),
])
def test_bad_constraint_values_name_their_key(sampling, message):
    assert message in error_of(sampling=sampling)


def test_json_schema_file_is_read_relative_to_the_job_file(tmp_path, monkeypatch):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "label.json").write_text(json.dumps(SCHEMA, indent=2) + "\n")
    job_path = tmp_path / "jobs" / "job.yaml"
    job_path.write_text(yaml.safe_dump({"input": {"path": "in.parquet"}, "output": {"path": "out"},
                                        "sampling": {"json_schema_file": "label.json"}}))
    monkeypatch.chdir(tmp_path)  # not the job file's directory
    config = load_job(job_path)
    assert config.sampling.json_schema == (tmp_path / "jobs" / "label.json").read_text()  # the content, as written
    assert "json_schema_file" not in config.to_dict()["sampling"]  # read into json_schema: one fact in one place
    # without a job file, a relative path is found from the current directory
    assert job(sampling={"json_schema_file": "jobs/label.json"}).sampling.json_schema == config.sampling.json_schema
    absolute = job(sampling={"json_schema_file": str(tmp_path / "jobs" / "label.json")})
    assert absolute.sampling.json_schema == config.sampling.json_schema


def test_json_schema_file_errors_name_the_key(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text('{"type": "object",')
    (tmp_path / "unknown.json").write_text('{"type": "nonsense"}')
    (tmp_path / "ok.json").write_text(json.dumps(SCHEMA))
    missing = tmp_path / "missing.json"
    assert error_of(sampling={"json_schema_file": str(missing)}) == \
        f"sampling.json_schema_file: cannot read {missing}: No such file or directory"
    assert error_of(sampling={"json_schema_file": str(tmp_path)}) == \
        f"sampling.json_schema_file: {tmp_path} is a directory, not a regular file"
    assert error_of(sampling={"json_schema_file": str(tmp_path / "broken.json")}).startswith(
        f"sampling.json_schema_file: {tmp_path / 'broken.json'}: json_schema is not valid JSON: ")
    assert error_of(sampling={"json_schema_file": str(tmp_path / "list.json")}) == \
        f"sampling.json_schema_file: {tmp_path / 'list.json'}: json_schema must be a JSON object (a schema), got list"
    assert error_of(sampling={"json_schema_file": str(tmp_path / "unknown.json")}).startswith(
        f"sampling.json_schema_file: {tmp_path / 'unknown.json'}: json_schema is not a JSON schema: at $.type: ")
    assert error_of(sampling={"json_schema_file": str(tmp_path / "ok.json"), "json_schema": SCHEMA}) == \
        "sampling.json_schema_file: set sampling.json_schema or sampling.json_schema_file, not both"
    assert error_of(sampling={"json_schema_file": 7}).startswith("sampling.json_schema_file: expected a string, got 7")
    assert "did you mean sampling.json_schema_file?" in error_of(sampling={"json_schema_fil": "x.json"})
    # a file schema next to another constraint: the job's one-constraint rule
    assert "set at most one of choice, regex, json_schema, grammar" in \
        error_of(sampling={"json_schema_file": str(tmp_path / "ok.json"), "choice": ["A"]})


def test_parse_json_needs_a_job_schema(tmp_path):
    assert error_of(output={"parse_json": True}) == \
        "output.parse_json: needs sampling.json_schema (or sampling.json_schema_file): the json column is typed from it"
    assert "output.parse_json: needs sampling.json_schema" in \
        error_of(output={"parse_json": True}, sampling={"regex": "a+"})
    assert error_of(output={"parse_json": "yes"}) == "output.parse_json: expected true or false, got 'yes'"
    assert job(output={"parse_json": True}, sampling={"json_schema": SCHEMA}).output.parse_json is True
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    assert job(output={"parse_json": True}, sampling={"json_schema_file": str(tmp_path / "s.json")}).output.parse_json
    assert job().output.parse_json is False


def test_set_overrides_reach_the_new_keys(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("input:\n  path: in.parquet\noutput:\n  path: out\n")
    config = load_job(path, ["sampling.choice=['yes', 'no']", "sampling.n=3", "sampling.logprobs=0"])
    assert (config.sampling.choice, config.sampling.n, config.sampling.logprobs) == (("yes", "no"), 3, 0)
    with pytest.raises(JobConfigError, match=r"^sampling.choice\[0\]: expected a string, got True \(quote it"):
        load_job(path, ["sampling.choice=[yes, no]"])  # YAML's booleans
    with pytest.raises(JobConfigError, match=r"^sampling.regex: regex does not compile"):
        load_job(path, ["sampling.regex=(\\d"])


def test_fingerprint_holds_the_schema_file_content_not_its_path(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"prompt": ["a", "b"]})
    (tmp_path / "a.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "b.json").write_text(json.dumps(SCHEMA))

    def fingerprint(schema_file: str) -> dict:
        config = parse_job({"input": {"path": str(tmp_path / "in.parquet")}, "output": {"path": "out"},
                            "sampling": {"json_schema_file": schema_file}})
        return job_fingerprint(config, "m", inspect_input(config))

    first = fingerprint(str(tmp_path / "a.json"))
    assert json.loads(first["sampling"]["json_schema"]) == SCHEMA
    assert describe_changes(first, fingerprint(str(tmp_path / "b.json"))) == ""  # same content, another path
    (tmp_path / "a.json").write_text(json.dumps({**SCHEMA, "required": ["label"]}))
    assert describe_changes(first, fingerprint(str(tmp_path / "a.json"))) == "sampling changed"


# -- per-row overrides ----------------------------------------------------------------------------------------------

def source_rows(tmp_path, columns: dict, schema: pa.Schema | None = None, **sections):
    path = write_parquet(tmp_path / "in.parquet", columns, schema)
    raw = {"input": {"path": str(path), "chat_template": False, "sort": "none"}, "output": {"path": "out"}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    config = parse_job(raw)
    return list(read_source(config, inspect_input(config), ByteTokenizer(), None))


def test_row_columns_override_the_new_keys(tmp_path):
    rows = source_rows(tmp_path, {
        "prompt": ["a", "b", "c", "d"],
        "n": [3, None, 2.0, None],
        "logprobs": [None, 4, None, None],
        "choice": [["x", "y"], None, [], None],
        "regex": [None, None, None, r"\d+"],
    }, sampling={"choice": ["FILES", "TEXT"], "n": 2})
    assert [row.error for row in rows] == [None] * 4
    params = [row.sampling for row in rows]
    assert [(p.n, p.logprobs) for p in params] == [(3, None), (2, 4), (2, None), (2, None)]
    assert isinstance(params[2].n, int)  # a float column's whole value
    assert params[0].choice == ["x", "y"]  # the row's choices
    assert params[1].choice == ["FILES", "TEXT"] and params[2].choice == ["FILES", "TEXT"]  # null, []: the job's
    # a row's regex replaces the job's choice: the row is constrained by its regex alone
    assert (params[3].choice, params[3].constraint) == ([], ("regex", r"\d+"))


def test_row_schema_and_grammar_replace_the_job_constraint(tmp_path):
    row_schema = json.dumps({"type": "array", "items": {"type": "integer"}})
    rows = source_rows(tmp_path, {"prompt": ["a", "b", "c"], "json_schema": [row_schema, None, None],
                                  "grammar": [None, 'root ::= "ok"', None]},
                       sampling={"json_schema": SCHEMA})
    assert [row.error for row in rows] == [None] * 3
    assert rows[0].sampling.constraint == ("json_schema", row_schema)
    assert rows[1].sampling.constraint == ("grammar", 'root ::= "ok"') and rows[1].sampling.json_schema is None
    assert rows[2].sampling.constraint == ("json_schema", json.dumps(SCHEMA))


def test_bad_row_values_are_row_errors(tmp_path):
    rows = source_rows(tmp_path, {
        "prompt": ["bad regex", "bad schema", "two constraints", "bad n", "bad choice", "fine"],
        "regex": ["(\\d", None, "a+", None, None, None],
        "json_schema": [None, "{not json", None, None, None, None],
        "grammar": [None, None, 'root ::= "x"', None, None, None],
        "n": [None, None, None, 500, None, None],
        "choice": [None, None, None, None, ["a", "a"], None],
    }, sampling={"choice": ["A", "B"]})
    errors = [row.error for row in rows]
    assert errors[0].startswith("invalid per-row sampling value: regex does not compile: Regex parsing error")
    assert errors[1].startswith("invalid per-row sampling value: json_schema is not valid JSON")
    assert errors[2] == ("invalid per-row sampling value: set at most one of choice, regex, json_schema, grammar; "
                         "got regex and grammar")
    assert errors[3] == "invalid per-row sampling value: n must be in [1, 128], got 500"
    assert errors[4] == "invalid per-row sampling value: choice lists a string twice"
    assert errors[5] is None and rows[5].sampling.choice == ["A", "B"]
    assert all(row.token_ids is None and row.sampling is None for row in rows[:5])


# -- which columns the output has -----------------------------------------------------------------------------------

@pytest.mark.parametrize("sections, input_columns, present", [
    ({}, [], []),
    ({"sampling": {"n": 1}}, [], []),
    ({"sampling": {"n": 2}}, [], ["sample_index"]),
    ({}, ["n"], ["sample_index"]),
    ({"sampling": {"choice": ["A", "B"]}}, [], ["choice_probs"]),
    ({}, ["choice"], ["choice_probs"]),
    ({"sampling": {"logprobs": 0}}, [], ["logprobs", "top_logprobs"]),
    ({}, ["logprobs"], ["logprobs", "top_logprobs"]),
    ({"sampling": {"json_schema": SCHEMA}}, [], []),  # a schema alone: the text only
    ({"sampling": {"json_schema": SCHEMA}, "output": {"parse_json": True}}, [], ["json"]),
    ({"sampling": {"json_schema": SCHEMA, "n": 3, "logprobs": 2}, "output": {"parse_json": True}}, ["choice"],
     CONDITIONAL),
])
def test_conditional_columns_only_when_asked(sections, input_columns, present):
    options = output_options(job(**sections), {name: pa.int64() for name in ["prompt", *input_columns]})
    schema = output_schema(pa.string(), [("tag", pa.int8())], options)
    generated = [c for c in COLUMNS if "generate" in c.tasks]
    assert schema.names == [c.name for c in generated if c.only is None or c.name in present] + ["tag"]


def test_conditional_column_types():
    config = job(sampling={"json_schema": SCHEMA, "n": 2, "logprobs": 1, "choice": []},
                 output={"parse_json": True})
    schema = output_schema(pa.int64(), [], output_options(config, {"choice": pa.list_(pa.string())}))
    assert schema.field("sample_index").type == pa.int32()
    assert schema.field("choice_probs").type == pa.list_(pa.struct([("choice", pa.string()), ("prob", pa.float64())]))
    assert schema.field("logprobs").type == pa.list_(pa.float64())
    assert schema.field("top_logprobs").type == pa.list_(pa.list_(pa.struct(
        [("token", pa.string()), ("token_id", pa.int32()), ("logprob", pa.float64())])))
    assert schema.field("json").type == pa.struct([("label", pa.string()), ("score", pa.int64())])


def test_keep_columns_may_not_take_a_conditional_column_name():
    assert error_of(output={"keep_columns": ["choice_probs"]}) == \
        "output.keep_columns: 'choice_probs' clashes with an output column"


# -- the json column: its type and values ---------------------------------------------------------------------------

@pytest.mark.parametrize("schema, arrow_type", [
    ({"type": "string"}, pa.string()),
    ({"type": "integer"}, pa.int64()),
    ({"type": "number"}, pa.float64()),
    ({"type": "boolean"}, pa.bool_()),
    ({"type": ["string", "null"]}, pa.string()),
    ({"type": "array", "items": {"type": "number"}}, pa.list_(pa.float64())),
    ({"type": "array"}, pa.list_(pa.string())),  # items of no type: their JSON text
    ({"enum": ["a", "b"]}, pa.string()),
    ({"const": "x"}, pa.string()),
    ({"enum": [1, "b"]}, pa.string()),  # JSON text
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, pa.string()),
    ({"$ref": "#/$defs/x"}, pa.string()),
    ({}, pa.string()),
    ({"type": "object"}, pa.string()),  # no properties
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}, pa.string()),
    ({"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}},
     pa.struct([("b", pa.bool_()), ("a", pa.list_(pa.struct([("x", pa.int64())])))])),
])
def test_json_schema_to_arrow_type(schema, arrow_type):
    assert json_type(schema).arrow == arrow_type


def ok_result(text: str, finish: str = "stop", error: str | None = None, **fields) -> Result:
    t = 1_700_000_000.0
    return Result(request_id=0, text=text, token_ids=[1], finish_reason=finish, error=error, prompt_tokens=3,
                  output_tokens=1, cached_tokens=0, num_preemptions=0, arrival_time=t, first_scheduled_time=t,
                  first_token_time=t, finish_time=t + 1, **fields)


NESTED = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "height": {"type": "number"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}}, "extra": {"anyOf": [{"type": "integer"}, {}]},
    "nick": {"type": ["string", "null"]}, "ok": {"type": "boolean"}}}


def test_json_values_convert_to_the_schema_types():
    t = json_type(NESTED)
    value, error = parse_json_output(ok_result(
        '{"name": "Ann", "age": 3.0, "height": 2, "tags": ["b"], "extra": {"k": [1, "é"]}, "nick": null}'), t)
    assert error is None
    assert value == {"name": "Ann", "age": 3, "height": 2.0, "tags": ["b"], "extra": '{"k": [1, "é"]}',
                     "nick": None, "ok": None}  # a property the text leaves out is null
    assert isinstance(value["age"], int) and isinstance(value["height"], float)
    # it fits the column's type
    assert pa.array([value], type=t.arrow).to_pylist() == [value]


@pytest.mark.parametrize("text, error", [
    ('{"name": 5}', "the JSON does not fit sampling.json_schema: $.name is 5, the schema wants a string"),
    ('{"age": 1.5}', "$.age is 1.5, the schema wants an integer"),
    ('{"age": 9223372036854775808}', "$.age is 9223372036854775808, outside int64"),
    ('{"age": true}', "$.age is true, the schema wants an integer"),
    ('{"tags": ["c"]}', "$.tags[0] is 'c', not one of the schema's values"),
    ('{"tags": "a"}', '$.tags is "a", the schema wants an array'),
    ('{"name": null}', "$.name is null, the schema wants a string"),
    ('{"other": 1}', "$ has the key 'other', which the schema does not list"),
    ('[1]', "$ is an array, the schema wants an object"),
    ('{"name": "A"', "the text is not JSON: Expecting ',' delimiter"),
    ('', "the text is not JSON: Expecting value"),
])
def test_a_text_that_does_not_parse_or_fit_has_a_null_json_and_says_why(text, error):
    value, message = parse_json_output(ok_result(text), json_type(NESTED))
    assert value is None and error in message


def test_length_and_error_rows_have_no_json():
    t = schema_json_type(json.dumps(SCHEMA))
    assert parse_json_output(ok_result('{"label": "x", "sc', finish="length"), t) == (None, LENGTH_ERROR)
    assert LENGTH_ERROR == "max_tokens reached before the JSON closed"
    assert parse_json_output(ok_result("", finish="error", error="boom"), t) == (None, None)
    assert parse_json_output(ok_result('"just text"'), JsonType("text")) == ('"just text"', None)


def make_out(tmp_path) -> OutputDir:
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    out.prepare_tmp()
    return out


def test_part_writer_writes_the_conditional_columns(tmp_path):
    config = job(sampling={"json_schema": SCHEMA, "n": 2, "logprobs": 1}, output={"parse_json": True})
    options = output_options(config, {"choice": pa.list_(pa.string())})
    out = make_out(tmp_path)
    writer = PartWriter(out, output_schema(pa.string(), [], options), "{}", 100, 60.0, True, json_type=options.json)
    top = [[("ok", 7, -0.1)], [("!", 3, -0.2)]]
    writer.add(0, "r0", (),
               ok_result('{"label": "a", "score": 2}', sample_index=0, logprobs=[-0.1, -0.2], top_logprobs=top),
               ok_result('{"label": "b", "score": 1}', sample_index=1, choice_probs=[("x", 0.25), ("y", 0.75)]))
    writer.add(1, "r1", (), ok_result('{"label": "c", "sco', finish="length"))
    writer.add(2, "r2", (), ok_result('{"label": 1, "score": 2}'))
    writer.add(3, "r3", (), ok_result("", finish="error", error="prompt is empty"))
    writer.commit()
    rows = pq.read_table(out.run_parts()[0]).to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [("r0", 0), ("r0", 1), ("r1", 0), ("r2", 0), ("r3", 0)]
    assert [r["json"] for r in rows] == [{"label": "a", "score": 2}, {"label": "b", "score": 1}, None, None, None]
    assert [r["error"] for r in rows] == [
        None, None, LENGTH_ERROR,
        "the JSON does not fit sampling.json_schema: $.label is 1, the schema wants a string", "prompt is empty"]
    assert [r["finish_reason"] for r in rows] == ["stop", "stop", "length", "stop", "error"]  # unchanged
    assert rows[3]["text"] == '{"label": 1, "score": 2}'  # kept
    assert rows[0]["logprobs"] == [-0.1, -0.2] and rows[1]["logprobs"] is None
    assert rows[0]["top_logprobs"] == [[{"token": "ok", "token_id": 7, "logprob": -0.1}],
                                       [{"token": "!", "token_id": 3, "logprob": -0.2}]]
    assert rows[1]["choice_probs"] == [{"choice": "x", "prob": 0.25}, {"choice": "y", "prob": 0.75}]
    assert rows[0]["choice_probs"] is None


# -- n samples per row: grouping, order, totals ---------------------------------------------------------------------

def samples_of(request, reverse: bool = False) -> list[Result]:
    """The fake engine's results for one request: its n samples together, with the constraint's kind of text."""
    p, now = request.sampling_params, 1_700_000_000.0 + request.request_id
    results = []
    for i in range(p.n):
        if p.choice:
            text, probs = p.choice[i % len(p.choice)], [(c, 1 / len(p.choice)) for c in p.choice]
        else:
            text, probs = json.dumps({"label": f"r{request.request_id}", "score": i}), None
        finish = "length" if p.max_tokens < 4 else "stop"
        if finish == "length":
            text = text[:p.max_tokens]
        logprobs = None if p.logprobs is None else [-0.5, -0.25]
        top = None if p.logprobs is None else [[("t", 1, -0.5)] * p.logprobs] * 2
        results.append(Result(request_id=request.request_id, text=text, token_ids=[1, 2], finish_reason=finish,
                              error=None, prompt_tokens=len(request.prompt_token_ids), output_tokens=2,
                              cached_tokens=0, num_preemptions=0, arrival_time=now, first_scheduled_time=now,
                              first_token_time=now, finish_time=now + 1, sample_index=i, choice_probs=probs,
                              logprobs=logprobs, top_logprobs=top))
    return results[::-1] if reverse else results


def fake_generate(order=None, reverse=False):
    """Generate each request's samples together; `order` finishes the requests of a window in another order."""
    def generate(requests):
        pending = list(requests)
        for index in (order or range(len(pending))):
            yield from samples_of(pending[index], reverse)
    return generate


def sample_job(tmp_path, columns: dict, **sections) -> PreparedJob:
    path = write_parquet(tmp_path / "in.parquet", columns)
    raw = {"input": {"path": str(path), "chat_template": False, "sort": "none", "id_column": "key"},
           "output": {"path": str(tmp_path / "out"), "rows_per_part": 3}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    config = parse_job(raw)
    inputs = inspect_input(config)
    prepared = PreparedJob(config, inputs, job_fingerprint(config, "fake", inputs), OutputDir(tmp_path / "out"))
    prepared.out.path.mkdir()
    prepared.out.prepare_tmp()
    return prepared


def stream(prepared: PreparedJob, generate, done=None) -> list[list[Result]]:
    config = prepared.config
    writer = PartWriter(prepared.out, prepared.schema, fingerprint_text(prepared.fingerprint),
                        config.output.rows_per_part, 60.0, config.output.order == "input",
                        json_type=prepared.options.json)
    groups = []
    stream_rows(read_source(config, prepared.inputs, ByteTokenizer(), None, done), generate, writer, groups.append,
                json_schema=config.sampling.json_schema)
    writer.commit()
    return groups


def finish(prepared: PreparedJob) -> dict:
    summary = lambda totals: {"rows": totals.rows, "output_rows": totals.output_rows, "rows_ok": totals.rows_ok,
                              "rows_error": totals.rows_error, "output_tokens": totals.output_tokens}
    return finalize(prepared.out, prepared.schema, prepared.inputs.total_rows, prepared.config.output.order,
                    prepared.config.output.rows_per_part, summary)


def test_samples_are_committed_together_and_finalized_in_row_then_sample_order(tmp_path):
    keys = [f"k{i}" for i in range(7)]
    prepared = sample_job(tmp_path, {"key": keys, "prompt": ["p0", "p1", "", "p3", "p4", "p5", "p6"],
                                     "n": [2, None, None, 1, 3, None, 2]},
                          sampling={"n": 2, "logprobs": 1, "json_schema": SCHEMA}, output={"parse_json": True})
    groups = stream(prepared, fake_generate(order=[4, 0, 5, 2, 1, 3], reverse=True))
    # the error row first (it skips the engine), then the rows as the engine finished them, each with its n samples
    assert [(group[0].request_id, len(group)) for group in groups] == \
        [(2, 1), (5, 2), (0, 2), (6, 2), (3, 1), (1, 2), (4, 3)]
    assert all([r.sample_index for r in group] == list(range(len(group))) for group in groups)  # put in order
    # no part holds only some of a row's samples: every row is in exactly one part
    seen = {}
    for part in prepared.out.run_parts():
        table = pq.read_table(part)
        rows, samples = table[ROW_COLUMN].to_pylist(), table["sample_index"].to_pylist()
        assert list(zip(rows, samples)) == sorted(zip(rows, samples))  # sorted by (_row, sample_index)
        for row in set(rows):
            assert row not in seen, f"row {row} is split across {seen.get(row)} and {part.name}"
            seen[row] = part.name
    assert sorted(seen) == list(range(7))
    assert any(len(pq.read_table(p)) > 3 for p in prepared.out.run_parts())  # a group kept whole past rows_per_part
    assert list(prepared.out.done_rows(7)) == [1] * 7

    summary = finish(prepared)
    table = ds.dataset(prepared.out.path).to_table()
    wanted = [(key, i) for key, n in zip(keys, [2, 2, 1, 1, 3, 2, 2]) for i in range(n)]  # the error row: one
    assert list(zip(table["id"].to_pylist(), table["sample_index"].to_pylist())) == wanted
    assert summary == {"rows": 7, "output_rows": 13, "rows_ok": 6, "rows_error": 1, "output_tokens": 24,
                       "parts": ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]}
    assert table.filter(pa.compute.equal(table["id"], "k4"))["json"].to_pylist() == \
        [{"label": "r4", "score": i} for i in range(3)]
    error_row = table.filter(pa.compute.equal(table["id"], "k2")).to_pylist()[0]
    assert (error_row["error"], error_row["json"], error_row["logprobs"]) == ("prompt is empty", None, None)


def test_completion_order_keeps_a_rows_samples_together(tmp_path):
    prepared = sample_job(tmp_path, {"key": list("abcde"), "prompt": list("vwxyz")},
                          sampling={"n": 3, "choice": ["yes", "no"]}, output={"order": "completion"})
    order = [3, 1, 4, 0, 2]
    stream(prepared, fake_generate(order=order, reverse=True))
    summary = finish(prepared)
    table = ds.dataset(prepared.out.path).to_table()
    assert list(zip(table["id"].to_pylist(), table["sample_index"].to_pylist())) == \
        [("abcde"[row], i) for row in order for i in range(3)]
    assert table["text"].to_pylist()[:3] == ["yes", "no", "yes"]
    assert table["choice_probs"].to_pylist()[0] == [{"choice": "yes", "prob": 0.5}, {"choice": "no", "prob": 0.5}]
    assert (summary["rows"], summary["output_rows"]) == (5, 15)


def test_too_few_samples_from_the_engine_is_an_internal_error(tmp_path):
    prepared = sample_job(tmp_path, {"key": ["a", "b"], "prompt": ["x", "y"]}, sampling={"n": 3})

    def short(requests):
        for request in requests:
            yield from samples_of(request)[:2]

    with pytest.raises(RuntimeError, match="internal error: the engine returned 2 of the 3 samples of row 0"):
        stream(prepared, short)
    assert prepared.out.run_parts() == []  # nothing of the incomplete rows was committed


def test_a_row_missing_from_the_output_is_still_refused_with_samples(tmp_path):
    prepared = sample_job(tmp_path, {"key": ["a", "b"], "prompt": ["x", "y"]}, sampling={"n": 3})
    stream(prepared, fake_generate(order=[0]))  # the engine never finishes row 1
    with pytest.raises(RuntimeError, match="internal error: 1 rows committed for 2 input rows"):
        finish(prepared)


# -- a whole run through the CLI, the engine replaced by the fake ---------------------------------------------------

class FakeEngine:
    """Stands in for the loaded engine: the byte tokenizer, each request's samples together, and after `fail_after`
    results a device failure."""

    max_model_len = 4096
    context_limit = "the model's context window is 4096 tokens"

    def __init__(self, fail_after: int | None = None):
        self.tokenizer = ByteTokenizer()
        self.fail_after = fail_after
        self.requested: list[int] = []

    def generate(self, requests, on_step=None):
        given = 0
        for request in requests:
            self.requested.append(request.request_id)
            for result in samples_of(request):
                if given == self.fail_after:
                    raise RuntimeError("device lost")
                given += 1
                yield result

    def stats(self) -> dict:
        return {}


def cli_job(tmp_path, rows: int, **sections) -> Path:
    write_parquet(tmp_path / "in.parquet", {"key": [f"q{i}" for i in range(rows)],
                                            "prompt": [f"question {i}" for i in range(rows)]})
    (tmp_path / "label.json").write_text(json.dumps(SCHEMA))
    raw = {"model": "default",
           "input": {"path": str(tmp_path / "in.parquet"), "id_column": "key", "chat_template": False},
           "sampling": {"json_schema_file": "label.json", "n": 3, "logprobs": 2},
           "output": {"path": str(tmp_path / "out"), "rows_per_part": 4, "parse_json": True}}
    for key, value in sections.items():
        raw[key] = {**raw[key], **value}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_run_and_resume_give_every_sample_once(tmp_path, monkeypatch):
    rows = 6
    path = cli_job(tmp_path, rows)
    out = tmp_path / "out"
    failing = FakeEngine(fail_after=3 * 3 + 1)  # three rows' samples, then one sample of the fourth row
    monkeypatch.setattr(local, "load_engine", lambda prepared: failing)
    result = CliRunner().invoke(main, ["run", str(path), "--quiet"])
    assert result.exit_code == 1 and "runtime failure: RuntimeError: device lost" in result.stderr
    committed = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("run-*.parquet")))
    done_rows = sorted(set(committed[ROW_COLUMN].to_pylist()))
    assert done_rows == [0, 1, 2]  # whole rows only: the fourth row's one sample was not committed
    assert committed.num_rows == 9 and not (out / "_SUCCESS").exists()
    for part in out.glob("run-*.parquet"):  # each committed row has all of its samples in its part
        table = pq.read_table(part)
        for row in set(table[ROW_COLUMN].to_pylist()):
            assert sorted(s for r, s in zip(table[ROW_COLUMN].to_pylist(), table["sample_index"].to_pylist())
                          if r == row) == [0, 1, 2]

    resumed = FakeEngine()
    monkeypatch.setattr(local, "load_engine", lambda prepared: resumed)
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 0, result.output
    assert "6 (this run: 3): 6 ok, 0 error; 18 output rows (samples)" in result.stderr
    assert "input columns that set sampling per row" not in result.stderr
    assert sorted(resumed.requested) == [3, 4, 5]  # committed rows are not generated again
    table = ds.dataset(out).to_table()
    assert list(zip(table["id"].to_pylist(), table["sample_index"].to_pylist())) == \
        [(f"q{row}", i) for row in range(rows) for i in range(3)]  # every (id, sample_index) exactly once
    assert table["json"].to_pylist()[:2] == [{"label": "r0", "score": 0}, {"label": "r0", "score": 1}]
    assert table.schema.names[:3] == ["id", "sample_index", "text"] and "choice_probs" not in table.schema.names
    assert table["top_logprobs"].to_pylist()[0] == [[{"token": "t", "token_id": 1, "logprob": -0.5}] * 2] * 2
    summary = json.loads((out / "_SUCCESS").read_text())
    assert (summary["rows"], summary["output_rows"], summary["rows_ok"], summary["rows_error"]) == (6, 18, 6, 0)
    assert (summary["rows_this_run"], summary["resumed"]) == (3, True)
    assert summary["output_tokens"] == 36
    assert json.loads(summary["fingerprint"]["sampling"]["json_schema"]) == SCHEMA


def test_a_bad_row_regex_is_a_row_error_and_the_job_completes(tmp_path, monkeypatch, caplog):
    write_parquet(tmp_path / "in.parquet", {"prompt": ["a", "b"], "regex": ["(\\d", None]})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"input": {"path": str(tmp_path / "in.parquet"), "chat_template": False},
                                    "sampling": {"choice": ["A", "B"]}, "output": {"path": str(tmp_path / "out")}}))
    monkeypatch.setattr(local, "load_engine", lambda prepared: FakeEngine())
    with caplog.at_level("INFO", logger="batchgen.job.runner"):
        result = CliRunner().invoke(main, ["run", str(path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "input columns that set sampling per row: regex" in caplog.text
    rows = ds.dataset(tmp_path / "out").to_table().to_pylist()
    assert rows[0]["finish_reason"] == "error" and rows[0]["error"].startswith(
        "invalid per-row sampling value: regex does not compile")
    assert rows[1]["text"] == "A" and rows[1]["choice_probs"] == [{"choice": "A", "prob": 0.5},
                                                                   {"choice": "B", "prob": 0.5}]


@pytest.mark.parametrize("sampling, output, message", [
    ({"regex": "(\\d"}, {}, "batchgen: error: sampling.regex: regex does not compile: Regex parsing error at "
                            "position 4: The parenthesis is not closed."),
    ({"json_schema_file": "nowhere.json"}, {}, "batchgen: error: sampling.json_schema_file: cannot read "),
    ({}, {"parse_json": True}, "batchgen: error: output.parse_json: needs sampling.json_schema"),
    ({"choice": ["A"], "grammar": 'root ::= "a"'}, {}, "batchgen: error: sampling.grammar: set at most one of"),
])
def test_job_level_constraint_errors_exit_2_before_the_model_loads(tmp_path, monkeypatch, sampling, output,
                                                                   message):
    write_parquet(tmp_path / "in.parquet", {"prompt": ["a"]})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"input": {"path": str(tmp_path / "in.parquet")}, "sampling": sampling,
                                    "output": {"path": str(tmp_path / "out"), **output}}))
    loads = []
    monkeypatch.setattr(local, "load_engine", lambda prepared: loads.append(prepared))
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.strip().startswith(message) and "\n" not in result.stderr.strip()
    assert loads == [] and not (tmp_path / "out").exists()


def test_a_constrained_job_without_xgrammar_exits_2_with_the_pip_command(tmp_path):
    """xgrammar is an optional extra: without it a regex job stops before the model loads, saying how to install
    it."""
    import subprocess
    import sys

    write_parquet(tmp_path / "in.parquet", {"prompt": ["a"]})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"input": {"path": str(tmp_path / "in.parquet")}, "sampling": {"regex": "[a-z]+"},
                                    "output": {"path": str(tmp_path / "out")}}))
    hide = "import sys; sys.modules['xgrammar'] = None; from batchgen.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", hide, "plan", str(path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert "sampling.regex" in done.stderr and "pip install 'xgrammar==0.2.9'" in done.stderr


def test_the_engine_is_sized_for_every_sample_and_candidate_of_the_rows_left():
    from batchgen.job.prepare import engine_args_for

    base = {"input": {"path": "x.parquet"}, "output": {"path": "out"}}
    assert engine_args_for(parse_job(base), 3).max_num_seqs == 3
    assert engine_args_for(parse_job({**base, "sampling": {"n": 4}}), 3).max_num_seqs == 12
    assert engine_args_for(parse_job({**base, "sampling": {"choice": ["a", "b", "c"]}}), 2).max_num_seqs == 6
    assert engine_args_for(parse_job({**base, "sampling": {"n": 8}}), 1000).max_num_seqs == 256  # the setting
