"""The job layer's input and output sides on real Parquet files and the default model's real tokenizer
(no model weights loaded): finding and checking input, prompt building, bad rows, sorting, part files, the
ledger and the crash-safe final rewrite."""
from __future__ import annotations

import json
import math
import os

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.engine.request import Result
from batchgen.job.output import output_dir as sink_module
from batchgen.job.output import parts
from batchgen.job.config import JobConfigError, parse_job
from batchgen.job.output.schema import OUTPUT_COLUMNS, ROW_COLUMN, output_schema
from batchgen.job.output.final_rewrite import RowTotals, apply_rewrite, finalize
from batchgen.job.output.part_writer import PartWriter
from batchgen.job.output.output_dir import SCRATCH_MARK, OutputDir
from batchgen.job.input.files import find_input_files, inspect_input
from batchgen.job.input.source import SourceRow, read_source, sort_windows


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from batchgen.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


def job(input_path, output_path="out", **sections):
    raw = {"input": {"path": str(input_path)}, "output": {"path": str(output_path)}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_job(raw)


def write_parquet(path, columns: dict, schema=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def rows_of(config, tokenizer, max_model_len=None, done=None):
    return list(read_source(config, inspect_input(config), tokenizer, max_model_len, done))


def encode_chat(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer([text], add_special_tokens=False)["input_ids"][0]


# -- finding and checking input ------------------------------------------------------------------------------------

def test_find_input_files_file_directory_glob(tmp_path):
    a = write_parquet(tmp_path / "d" / "b.parquet", {"prompt": ["x"]})
    b = write_parquet(tmp_path / "d" / "a.parquet", {"prompt": ["y"]})
    c = write_parquet(tmp_path / "d" / "sub" / "c.parquet", {"prompt": ["z"]})
    write_parquet(tmp_path / "d" / ".hidden.parquet", {"prompt": ["h"]})
    write_parquet(tmp_path / "d" / "_tmp" / "e.parquet", {"prompt": ["e"]})
    (tmp_path / "d" / "notes.txt").write_text("not parquet")
    assert find_input_files(str(a)) == [a]
    assert find_input_files(str(tmp_path / "d")) == [b, a, c]
    assert find_input_files(str(tmp_path / "d" / "*.parquet")) == [b, a]
    with pytest.raises(JobConfigError, match="input.path: no such file or directory"):
        find_input_files(str(tmp_path / "missing.parquet"))
    with pytest.raises(JobConfigError, match="input.path: no input files found"):
        find_input_files(str(tmp_path / "d" / "*.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobConfigError, match="input.path: no input files found"):
        find_input_files(str(tmp_path / "empty"))


@pytest.mark.parametrize("sections, message", [
    ({}, "input.prompt_column: column 'prompt' not found in"),
    ({"input": {"prompt_column": "question", "id_column": "key"}}, "input.id_column: column 'key' not found"),
    ({"input": {"template": "Q: {question}\n{context}"}}, "input.template: column 'context' not found"),
    ({"input": {"messages_column": "chat"}}, "input.messages_column: column 'chat' not found"),
    ({"input": {"prompt_column": "question", "system_column": "sys"}}, "input.system_column: column 'sys' not found"),
    ({"input": {"prompt_column": "question"}, "output": {"keep_columns": ["source"]}},
     "output.keep_columns: column 'source' not found"),
])
def test_missing_columns_name_key_file_and_column(tmp_path, sections, message):
    path = write_parquet(tmp_path / "in.parquet", {"question": ["q"], "id": [1]})
    with pytest.raises(JobConfigError) as info:
        inspect_input(job(path, **sections))
    assert message in str(info.value) and str(path) in str(info.value)
    assert "columns: question, id" in str(info.value)


def test_unreadable_parquet_and_type_mismatch(tmp_path):
    bad = tmp_path / "bad" / "x.parquet"
    bad.parent.mkdir()
    bad.write_text("this is not parquet")
    with pytest.raises(JobConfigError, match=r"input.path: .*x.parquet is not a readable Parquet file"):
        inspect_input(job(bad))
    write_parquet(tmp_path / "mixed" / "a.parquet", {"prompt": ["p"], "id": [1]})
    write_parquet(tmp_path / "mixed" / "b.parquet", {"prompt": ["p"], "id": ["one"]})
    with pytest.raises(JobConfigError, match="input.path: column 'id' is int64 in .*a.parquet but string in"):
        inspect_input(job(tmp_path / "mixed", input={"id_column": "id"}))
    # a column the job does not read may differ
    inspect_input(job(tmp_path / "mixed"))


# -- prompts, ids, keep columns ------------------------------------------------------------------------------------

def test_ids_are_positions_across_files_in_sorted_order(tmp_path, tokenizer):
    write_parquet(tmp_path / "d" / "2.parquet", {"prompt": ["c", "d", "e"], "tag": ["C", "D", "E"]})
    write_parquet(tmp_path / "d" / "1.parquet", {"prompt": ["a", "b"], "tag": ["A", "B"]})
    config = job(tmp_path / "d", engine={"sort": "none"}, output={"keep_columns": ["tag"]})
    rows = rows_of(config, tokenizer)
    assert [(r.row, r.id, r.keep) for r in rows] == [(0, 0, ("A",)), (1, 1, ("B",)), (2, 2, ("C",)),
                                                    (3, 3, ("D",)), (4, 4, ("E",))]
    assert inspect_input(config).total_rows == 5


@pytest.mark.parametrize("ids", [["k-1", "k-2"], [10, 7], [None, 3]])
def test_id_column_values_round_trip(tmp_path, tokenizer, ids):
    path = write_parquet(tmp_path / "in.parquet", {"prompt": ["a", "b"], "key": ids})
    rows = rows_of(job(path, input={"id_column": "key"}, engine={"sort": "none"}), tokenizer)
    assert [r.id for r in rows] == ids


def test_chat_template_with_system_prompt(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "in.parquet", {"prompt": ["What is 2+2?"]})
    [row] = rows_of(job(path, input={"system_prompt": "Answer tersely."}), tokenizer)
    assert row.error is None
    assert row.token_ids == encode_chat(tokenizer, [{"role": "system", "content": "Answer tersely."},
                                                    {"role": "user", "content": "What is 2+2?"}])
    assert row.prompt_tokens == len(row.token_ids)


def test_system_column_per_row_and_null_means_none(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "in.parquet", {"prompt": ["hi", "hey"], "sys": ["Be kind.", None]})
    rows = rows_of(job(path, input={"system_column": "sys"}, engine={"sort": "none"}), tokenizer)
    assert rows[0].token_ids == encode_chat(tokenizer, [{"role": "system", "content": "Be kind."},
                                                        {"role": "user", "content": "hi"}])
    assert rows[1].token_ids == encode_chat(tokenizer, [{"role": "user", "content": "hey"}])


def test_template_builds_prompt_from_columns(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "in.parquet", {"text": ["The cat sat."], "n": [3]})
    [row] = rows_of(job(path, input={"template": "Summarize in {n} words:\n{text}"}), tokenizer)
    assert row.token_ids == encode_chat(tokenizer, [{"role": "user", "content": "Summarize in 3 words:\nThe cat sat."}])


def test_raw_text_without_chat_template(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "in.parquet", {"prompt": ["Once upon a time"]})
    [row] = rows_of(job(path, input={"chat_template": False}), tokenizer)
    assert row.token_ids == tokenizer(["Once upon a time"], add_special_tokens=True)["input_ids"][0]


def test_messages_column(tmp_path, tokenizer):
    messages = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                 {"role": "user", "content": "Bye"}]]
    path = write_parquet(tmp_path / "in.parquet", {"chat": messages})
    [row] = rows_of(job(path, input={"messages_column": "chat", "system_prompt": "Sys."}), tokenizer)
    assert row.token_ids == encode_chat(tokenizer, [{"role": "system", "content": "Sys."}] + messages[0])


def test_per_row_sampling_overrides(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "in.parquet", {
        "prompt": ["a", "b", "c"], "max_tokens": [5, None, 7.0], "temperature": [None, 0.5, float("nan")],
        "seed": [None, 11, None]})
    rows = rows_of(job(path, sampling={"max_tokens": 9, "temperature": 0.0}, engine={"sort": "none"}), tokenizer)
    assert [r.error for r in rows] == [None, None, None]
    assert [(r.sampling.max_tokens, r.sampling.temperature, r.sampling.seed) for r in rows] == \
        [(5, 0.0, None), (9, 0.5, 11), (7, 0.0, None)]
    assert isinstance(rows[2].sampling.max_tokens, int)


def test_bad_rows_become_errors_and_keep_their_place(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "in.parquet", {
        "prompt": ["fine", None, "", "  \n", "x " * 300, "ok", "ok", "ok", "ok"],
        "temperature": [None, None, None, None, None, -1.0, None, None, None],
        "max_tokens": [None, None, None, None, None, None, 0, 2.5, None],
        "top_p": [None, None, None, None, None, None, None, None, 0.0]})
    rows = rows_of(job(path, engine={"sort": "none"}), tokenizer, max_model_len=128)
    errors = [r.error for r in rows]
    assert errors[0] is None and rows[0].token_ids
    assert "prompt is null" in errors[1]
    assert errors[2] == "prompt is empty" and errors[3] == "prompt is empty"
    assert "prompt is too long" in errors[4] and "context window is 128 tokens" in errors[4]
    assert rows[4].prompt_tokens > 128 and rows[4].token_ids is None
    assert "temperature must be >= 0" in errors[5]
    assert "max_tokens must be at least 1" in errors[6]
    assert "max_tokens must be an integer" in errors[7]
    assert "top_p must be in (0, 1]" in errors[8]
    assert [r.row for r in rows] == list(range(9))


def test_non_string_prompt_column_and_bad_messages(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "n.parquet", {"prompt": [1, 2]})
    with pytest.raises(JobConfigError, match=r"^input\.prompt_column: column 'prompt' is int64 in .*; it must hold "
                                             r"strings$"):
        inspect_input(job(path))  # every row would fail: refused with the job
    chat_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    path = write_parquet(tmp_path / "m.parquet", {"chat": pa.array(
        [None, [], [{"role": "user", "content": None}], [{"role": "user", "content": " "}]], chat_type)})
    rows = rows_of(job(path, input={"messages_column": "chat"}, engine={"sort": "none"}), tokenizer)
    assert "messages are null" in rows[0].error
    assert "non-empty list" in rows[1].error
    assert "string role and content" in rows[2].error
    assert rows[3].error == "prompt is empty"


def test_template_with_null_column_is_a_row_error(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "in.parquet", {"text": ["a", None]})
    rows = rows_of(job(path, input={"template": "T: {text}"}, engine={"sort": "none"}), tokenizer)
    assert rows[0].error is None and rows[1].error == "column 'text' is null"


def test_done_rows_are_skipped(tmp_path, tokenizer):
    write_parquet(tmp_path / "d" / "a.parquet", {"prompt": ["a", "b", "c"]})
    write_parquet(tmp_path / "d" / "b.parquet", {"prompt": ["d", "e"]})
    done = bytearray([1, 0, 1, 1, 1])
    rows = rows_of(job(tmp_path / "d"), tokenizer, done=done)
    assert [r.row for r in rows] == [1]


# -- sorting -------------------------------------------------------------------------------------------------------

def make_rows(token_lists):
    return [SourceRow(i, i, (), ids, None, None if ids else "bad") for i, ids in enumerate(token_lists)]


def test_sort_prefix_within_windows():
    ids = [[5, 1], [1, 2, 3], [1, 2], [9], [2, 2], [1, 9], None, [0]]
    out = list(sort_windows(make_rows(ids), window=4, how="prefix"))
    assert [r.row for r in out] == [2, 1, 0, 3, 6, 7, 5, 4]


def test_sort_length_and_none():
    ids = [[1, 1, 1], [2], [3, 3], [4, 4, 4, 4]]
    assert [r.row for r in sort_windows(make_rows(ids), 10, "length")] == [1, 2, 0, 3]
    assert [r.row for r in sort_windows(make_rows(ids), 2, "none")] == [0, 1, 2, 3]


def test_prefix_sort_groups_shared_prefixes(tmp_path, tokenizer):
    prompts = ["Translate: cat", "Summarize: dog", "Translate: bird", "Summarize: fish"]
    path = write_parquet(tmp_path / "in.parquet", {"prompt": prompts})
    rows = rows_of(job(path, input={"chat_template": False}), tokenizer)
    assert {rows[0].id, rows[1].id} in ({0, 2}, {1, 3})
    assert sorted(r.token_ids for r in rows) == [r.token_ids for r in rows]


# -- part files, ledger, final rewrite -----------------------------------------------------------------------------

def result(i, finish="stop", prompt=4, output=3, cached=0, t0=1_700_000_000.0):
    if finish == "error":
        return Result.for_error(i, "boom", prompt, t0)
    return Result(request_id=i, text=f"text {i}", token_ids=[1] * output, finish_reason=finish, error=None,
                  prompt_tokens=prompt, output_tokens=output, cached_tokens=cached, num_preemptions=1,
                  arrival_time=t0, first_scheduled_time=t0 + 0.25, first_token_time=t0 + 0.5, finish_time=t0 + 1.5)


SCHEMA = output_schema(pa.string(), [("tag", pa.int32())])
# not asked for by SCHEMA's job
CONDITIONAL = ("sample_index", "choice_probs", "logprobs", "top_logprobs", "json", "lora", "replica",
               "embedding", "label", "probs", "score", "logprob_sum", "num_scored_tokens", "perplexity",
               "token_logprobs", "num_truncated_tokens")  # the other tasks' (tests/test_task_config.py)


def test_output_schema_follows_the_contract():
    assert SCHEMA.names == [name for name in OUTPUT_COLUMNS if name not in CONDITIONAL] + ["tag"]


def writer_for(out, rows_per_part=3, sort_by_row=True, clock=lambda: 0.0, interval=60.0):
    return PartWriter(out, SCHEMA, json.dumps({"job": 1}), rows_per_part, interval, sort_by_row, clock)


def test_part_writer_commits_atomically_with_ledger(tmp_path):
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    out.prepare_tmp()
    writer = writer_for(out)
    for row in [4, 0, 2, 3, 1]:
        writer.add(row, f"id-{row}", (row * 10,), result(row))
    assert [p.name for p in out.run_parts()] == ["run-00000.parquet"]
    first = pq.read_table(out.run_parts()[0])
    assert first[ROW_COLUMN].to_pylist() == [0, 2, 4]  # sorted by input position
    assert first["id"].to_pylist() == ["id-0", "id-2", "id-4"] and first["tag"].to_pylist() == [0, 20, 40]
    assert json.loads(first.schema.metadata[parts.FINGERPRINT_KEY]) == {"job": 1}
    writer.commit()
    assert out.names() == ["run-00000.parquet", "run-00001.parquet"]  # nothing uncommitted in the output
    assert list(out.done_rows(7)) == [1, 1, 1, 1, 1, 0, 0]
    assert out.next_seq() == 2 and writer.committed_rows == 5
    assert {json.loads(s.metadata[parts.FINGERPRINT_KEY])["job"] for s in out.run_part_schemas().values()} == {1}


def test_part_writer_commits_on_interval(tmp_path):
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    out.prepare_tmp()
    now = [0.0]
    writer = writer_for(out, rows_per_part=100, clock=lambda: now[0], interval=5.0)
    writer.add(0, "a", (1,), result(0))
    assert out.run_parts() == []
    now[0] = 6.0
    writer.add(1, "b", (2,), result(1))
    assert len(out.run_parts()) == 1


def test_timing_columns_and_types(tmp_path):
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    out.prepare_tmp()
    writer = writer_for(out)
    writer.add(0, "a", (1,), result(0))
    writer.add(1, "b", (None,), result(1, finish="error"))
    writer.commit()
    table = pq.read_table(out.run_parts()[0])
    assert table.schema.field("finish_time").type == pa.timestamp("us", tz="UTC")
    ok, err = table.to_pylist()
    assert (ok["queue_s"], ok["ttft_s"], ok["e2e_s"]) == (0.25, 0.5, 1.5)
    assert math.isclose(ok["tpot_s"], 0.5)
    assert ok["first_token_time"] <= ok["finish_time"]
    assert err["ttft_s"] is None and err["tpot_s"] is None and err["queue_s"] is None and err["e2e_s"] == 0.0
    assert err["error"] == "boom" and err["first_token_time"] is None and err["tag"] is None


def committed_output(tmp_path, order_rows, rows_per_part=3, sort_by_row=True):
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    out.prepare_tmp()
    writer = writer_for(out, rows_per_part=rows_per_part, sort_by_row=sort_by_row)
    for row in order_rows:
        writer.add(row, f"id-{row}", (row,), result(row, finish="error" if row == 5 else "stop", cached=row % 2))
    writer.commit()
    return out


def summarize(totals: RowTotals) -> dict:
    return {"rows": totals.rows, "rows_error": totals.rows_error, "cached_tokens": totals.cached_tokens}


@pytest.mark.parametrize("rows_per_part", [1, 3, 4, 100])
def test_finalize_restores_input_order(tmp_path, rows_per_part):
    order = [7, 3, 9, 0, 5, 1, 8, 2, 6, 4]  # completion order
    out = committed_output(tmp_path, order)
    summary = finalize(out, SCHEMA, 10, "input", rows_per_part, summarize)
    parts = [f"part-{i:05d}.parquet" for i in range(math.ceil(10 / rows_per_part))]
    assert summary == {"rows": 10, "rows_error": 1, "cached_tokens": 4, "parts": parts}  # odd rows but the error row 5
    assert json.loads((out.path / "_SUCCESS").read_text()) == summary
    names = out.names()
    assert names[0] == "_SUCCESS" and all(n.startswith("part-") for n in names[1:])
    assert len(names) - 1 == math.ceil(10 / rows_per_part)
    table = pa.concat_tables(pq.read_table(out.path / n) for n in names[1:])
    assert table.schema.names == SCHEMA.names
    assert table["id"].to_pylist() == [f"id-{i}" for i in range(10)]
    assert not out.tmp.exists()


def test_finalize_completion_order(tmp_path):
    order = [7, 3, 9, 0, 5, 1, 8, 2, 6, 4]
    out = committed_output(tmp_path, order, sort_by_row=False)
    finalize(out, SCHEMA, 10, "completion", 3, summarize)
    assert ds.dataset(out.path).to_table()["id"].to_pylist() == [f"id-{i}" for i in order]


def test_finalize_empty_input_writes_one_empty_part(tmp_path):
    out = OutputDir(tmp_path / "out")
    out.path.mkdir()
    out.prepare_tmp()
    finalize(out, SCHEMA, 0, "input", 10, summarize)
    assert out.names() == ["_SUCCESS", "part-00000.parquet"]
    assert pq.read_table(out.path / "part-00000.parquet").schema.names == SCHEMA.names


def test_finalize_refuses_missing_rows(tmp_path):
    out = committed_output(tmp_path, [0, 1, 2])
    with pytest.raises(RuntimeError, match="3 rows committed for 4 input rows"):
        finalize(out, SCHEMA, 4, "input", 10, summarize)
    assert len(out.run_parts()) == 1 and not (out.path / "_SUCCESS").exists()


def test_finalize_crash_while_applying_is_finished_by_applying_again(tmp_path, monkeypatch):
    out = committed_output(tmp_path, [4, 0, 3, 1, 2, 5], rows_per_part=2)
    real_replace = os.replace
    moves = []

    def crash_on_second_final_part(src, dst):
        if str(dst).endswith(".parquet") and "part-" in os.path.basename(str(dst)) and \
                os.path.dirname(str(src)).endswith("final"):
            moves.append(dst)
            if len(moves) == 2:
                raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(sink_module.os, "replace", crash_on_second_final_part)
    with pytest.raises(OSError, match="simulated crash"):
        finalize(out, SCHEMA, 6, "input", 2, summarize)
    monkeypatch.setattr(sink_module.os, "replace", real_replace)
    # mid-way: run parts removed, one final part moved in, no _SUCCESS; the plan is still there
    assert out.run_parts() == [] and len(out.final_parts()) == 1 and out.success() is None
    assert out.pending_rewrite() is not None
    summary = apply_rewrite(out)
    assert summary["rows"] == 6 and out.success() == summary
    assert ds.dataset(out.path).to_table()["id"].to_pylist() == [f"id-{i}" for i in range(6)]
    assert not out.tmp.exists()


def test_finalize_crash_before_plan_leaves_run_parts(tmp_path, monkeypatch):
    out = committed_output(tmp_path, [1, 0, 2])
    before = sorted(p.name for p in out.run_parts())

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sink_module, "atomic_write_text", fail)
    with pytest.raises(OSError):
        finalize(out, SCHEMA, 3, "input", 2, summarize)
    monkeypatch.undo()
    assert sorted(p.name for p in out.run_parts()) == before and out.final_parts() == []
    assert out.pending_rewrite() is None
    finalize(out, SCHEMA, 3, "input", 2, summarize)  # a re-run starts the rewrite over
    assert ds.dataset(out.path).to_table()["id"].to_pylist() == ["id-0", "id-1", "id-2"]


def test_output_dir_classifies_files(tmp_path):
    """A file is batchgen's when it carries batchgen's fingerprint (for _SUCCESS: its JSON summary), not by name."""
    out = OutputDir(tmp_path / "job")
    assert out.tmp == tmp_path / ".job.batchgen-tmp"
    out.path.mkdir()
    ours = parts.final_part_schema(SCHEMA, json.dumps({"job": 1}))
    pq.write_table(ours.empty_table(), out.path / "part-00000.parquet")
    pq.write_table(parts.run_part_schema(SCHEMA, json.dumps({"job": 1})).empty_table(),
                   out.path / "run-00003.parquet")
    (out.path / "_SUCCESS").write_text(json.dumps({"fingerprint": {"job": 1}}))
    for name in [".DS_Store", "notes.csv"]:
        (out.path / name).write_text("")
    assert [p.name for p in out.run_parts()] == ["run-00003.parquet"]
    assert [p.name for p in out.final_parts()] == ["part-00000.parquet"]
    assert out.foreign_names() == ["notes.csv"]
    (out.path / "notes.csv").unlink()
    pq.write_table(SCHEMA.empty_table(), out.path / "part-00001.parquet")  # a name like ours, no fingerprint
    assert out.foreign_names() == ["part-00001.parquet"]
    out.prepare_tmp()
    (out.tmp / "run-00004.parquet.inprogress").write_text("half")
    out.remove_outputs()
    assert out.names() == [".DS_Store", "part-00001.parquet"] and [p.name for p in out.tmp.iterdir()] == [SCRATCH_MARK]
