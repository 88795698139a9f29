"""input.format: JSON lines and CSV (gzipped too) and OpenAI Batch request files, read through a Parquet copy in
batchgen's cache: the same output as the Parquet input with the same rows (real engine, default model); a line that
cannot be a row is that row's error and the rest run; the fingerprint keeps the text file's identity (a rewritten
file is refused on resume); `plan` reads them; column types follow the values; the OpenAI Batch body mapping,
field by field, with each request batchgen cannot serve as that request's error."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.job.input.openai_batch import BatchEndpoint
from batchgen.job.input.text_formats import INPUT_ERROR_COLUMN, MESSAGES_TYPE, stage, sweep_staged
from cli_runs import kill_after_parts, run_cli
from conftest import cache_sharing_builds

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "data" / "samples" / "prompts.parquet"
COMPARED = ["id", "text", "finish_reason", "error", "prompt_tokens", "output_tokens"]


def write_job(tmp_path: Path, name: str, input_path: Path, **input_keys) -> Path:
    job = {"model": "default", "dtype": "float32",
           "input": {"path": str(input_path), "id_column": "id", **input_keys},
           "sampling": {"max_tokens": 12}, "engine": {"max_num_seqs": 8},
           "output": {"path": str(tmp_path / name), "rows_per_part": 4}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def output(out: Path) -> pl.DataFrame:
    return pl.read_parquet(f"{out}/*.parquet")


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    """The sample prompts (id, topic, prompt, a per-row max_tokens column with nulls) as CSV, JSON lines and
    gzipped JSON lines; and the Parquet run's output."""
    tmp = tmp_path_factory.mktemp("formats")
    frame = pl.read_parquet(PROMPTS)
    files = {"csv": tmp / "prompts.csv", "jsonl": tmp / "prompts.jsonl", "jsonl.gz": tmp / "prompts.jsonl.gz"}
    frame.write_csv(files["csv"])
    frame.write_ndjson(files["jsonl"])
    files["jsonl.gz"].write_bytes(gzip.compress(files["jsonl"].read_bytes()))
    done = run_cli(write_job(tmp, "parquet", PROMPTS))
    assert done.returncode == 0, done.stderr[-3000:]
    return {**files, "parquet_out": tmp / "parquet"}


@pytest.mark.parametrize("kind", ["csv", "jsonl", "jsonl.gz"])
def test_a_text_input_gives_the_parquet_inputs_output(tmp_path, texts, kind, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(cache_sharing_builds(tmp_path / "cache")))
    cache = tmp_path / "cache" / "inputs"  # this test's own: its staged copies are what it checks
    cache.mkdir(parents=True)
    days = lambda n: time.time() - n * 86400
    for name, age in [("a" * 24 + ".parquet", 8), ("b" * 24 + ".parquet", 6), (".c.parquet.1.inprogress", 2)]:
        (cache / name).write_bytes(b"an earlier run's")  # copies of other files, unused for `age` days
        os.utime(cache / name, (days(age), days(age)))
    done = subprocess.run([sys.executable, "-m", "batchgen", "run", str(write_job(tmp_path, "out", texts[kind])),
                           "--quiet"], capture_output=True, text=True, timeout=900, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-3000:]
    ours, parquet = output(tmp_path / "out"), output(texts["parquet_out"])
    assert ours.select(COMPARED).equals(parquet.select(COMPARED))  # per-row max_tokens read from the text too
    fingerprint = json.loads((tmp_path / "out" / "_SUCCESS").read_text())["fingerprint"]
    [file] = fingerprint["files"]
    assert file["path"] == str(texts[kind].resolve()) and file["format"] == kind.removesuffix(".gz")
    assert file["rows"] == 30 and file["size"] == texts[kind].stat().st_size
    copies = sorted(path.name for path in cache.iterdir())  # this input's copy, made once; the week-old ones swept
    kept = "b" * 24 + ".parquet"
    assert len(copies) == 2 and kept in copies and all(name.endswith(".parquet") for name in copies), copies


def test_a_staged_copy_in_use_is_kept_and_one_unused_for_a_week_is_swept(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"prompt": "hi"}\n')
    first = stage(tmp_path / "t.jsonl", "jsonl", tmp_path, 100).path
    week_ago = time.time() - 8 * 86400
    os.utime(first, (week_ago, week_ago))
    assert stage(tmp_path / "t.jsonl", "jsonl", tmp_path, 100).path == first  # used again: marked
    assert sweep_staged(tmp_path) == [] and first.is_file()
    assert sweep_staged(tmp_path, now=time.time() + 8 * 86400) == [first] and not first.exists()
    assert sweep_staged(tmp_path / "absent") == []


def test_lines_that_cannot_be_rows_are_their_rows_errors(tmp_path):
    lines = ['{"id": 1, "prompt": "Say hi."}', "not json at all", "", "[1, 2]",
             '{"id": 4, "prompt": "Say bye.", "max_tokens": 3}', '{"id": 5}',
             '{"id": 6, "prompt": "Say yes.", "max_tokens": "ten"}']  # a stray kind in a number column: its row
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "in.csv").write_text('id,prompt\n1,Say hi.\n2,"two",extra\n3,"Say ""bye"",\nplease."\n')
    for name in ("in.jsonl", "in.csv"):
        done = run_cli(write_job(tmp_path, name + ".out", tmp_path / name))
        assert done.returncode == 0, done.stderr[-3000:]
    rows = output(tmp_path / "in.jsonl.out").select("id", "finish_reason", "error", "output_tokens").to_dicts()
    assert [(r["id"], r["finish_reason"] == "error") for r in rows] == [(1, False), (None, True), (None, True),
                                                                         (4, False), (5, True), (6, True)]  # blank: none
    assert rows[1]["error"].startswith("line 2 is not JSON: ") and rows[2]["error"] == "line 4 is not a JSON object"
    assert rows[3]["output_tokens"] == 3 and rows[4]["error"] == "prompt is null (column 'prompt')"
    assert rows[5]["error"] == 'max_tokens is "ten", not a number'  # the column stays int64: the other rows run
    rows = output(tmp_path / "in.csv.out").select("id", "finish_reason", "error").to_dicts()
    assert [r["finish_reason"] == "error" for r in rows] == [False, True, False]
    assert rows[1]["error"] == "line 3 has 3 fields, the header 2" and rows[2]["id"] == 3  # a quoted newline


def test_a_rewritten_text_input_is_refused_on_resume_and_plan_reads_it(tmp_path, texts):
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(texts["jsonl"].read_bytes())
    job = write_job(tmp_path, "out", source)
    planned = subprocess.run([sys.executable, "-m", "batchgen", "plan", str(job)], capture_output=True, text=True,
                             timeout=600)
    assert planned.returncode == 0 and "30 rows" in planned.stdout, planned.stdout + planned.stderr
    kill_after_parts(job, tmp_path / "out", 2)
    source.write_text(source.read_text().replace('"prompt":"', '"prompt":"Now: ', 1))
    refused = run_cli(job)
    assert refused.returncode == 2 and "prompts.jsonl" in refused.stderr.splitlines()[-1], refused.stderr
    source.write_bytes(texts["jsonl"].read_bytes())  # back as it was: a new mtime, so still another file
    assert run_cli(job).returncode == 2
    assert run_cli(job, "--overwrite").returncode == 0
    assert output(tmp_path / "out").select(COMPARED).equals(output(texts["parquet_out"]).select(COMPARED))


@pytest.mark.slow
def test_kill_9_on_a_jsonl_input_then_resume_gives_every_row_once(tmp_path, texts):
    job = write_job(tmp_path, "out", texts["jsonl"])
    kill_after_parts(job, tmp_path / "out", 2)
    assert run_cli(job).returncode == 0
    assert output(tmp_path / "out").select(COMPARED).equals(output(texts["parquet_out"]).select(COMPARED))


def test_column_types_follow_the_values(tmp_path):
    records = [{"i": 1, "f": 1, "b": True, "s": "x", "l": ["a"], "m": [{"role": "user", "content": "hi"}],
                "o": {"k": 1}, "mixed": 1},
               {"i": 2, "f": 2.5, "b": None, "s": None, "l": [], "m": [{"role": "user", "content": "yo"}],
                "o": [1], "mixed": "one"}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    table = pq.read_table(stage(tmp_path / "t.jsonl", "jsonl", tmp_path, 100).path)
    assert table.schema == pa.schema([("i", pa.int64()), ("f", pa.float64()), ("b", pa.bool_()), ("s", pa.string()),
                                      ("l", pa.list_(pa.string())), ("m", MESSAGES_TYPE), ("o", pa.string()),
                                      ("mixed", pa.string()), (INPUT_ERROR_COLUMN, pa.string())])
    assert table["o"].to_pylist() == ['{"k": 1}', "[1]"] and table["mixed"].to_pylist() == ["1", "one"]
    (tmp_path / "t.csv").write_bytes("\ufeffa,b,c\r\n1,1.5,x\r\n2,,7\r\n".encode())  # a spreadsheet's BOM and CRLF
    table = pq.read_table(stage(tmp_path / "t.csv", "csv", tmp_path, 100).path)
    assert table.schema.names[:3] == ["a", "b", "c"] and table["c"].to_pylist() == ["x", "7"]
    assert table.schema.types[:3] == [pa.int64(), pa.float64(), pa.string()] and table["b"].to_pylist() == [1.5, None]


def test_a_messages_column_from_json_lines(tmp_path):
    rows = [{"id": "a", "messages": [{"role": "system", "content": "Answer in one word."},
                                     {"role": "user", "content": "Capital of France?"}], "stop": ["\n"]}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    done = run_cli(write_job(tmp_path, "out", tmp_path / "chat.jsonl", messages_column="messages"))
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = output(tmp_path / "out").to_dicts()
    assert row["finish_reason"] in ("stop", "length") and "\n" not in row["text"]  # the row's own stop


def test_one_format_per_input_and_a_csv_without_a_header_is_named(tmp_path):
    (tmp_path / "d").mkdir()
    pl.read_parquet(PROMPTS).write_csv(tmp_path / "d" / "a.csv")
    pl.read_parquet(PROMPTS).write_ndjson(tmp_path / "d" / "b.jsonl")
    mixed = run_cli(write_job(tmp_path, "out", tmp_path / "d"))
    assert mixed.returncode == 2 and "several formats (csv, jsonl)" in mixed.stderr, mixed.stderr
    (tmp_path / "empty.csv").write_text("")
    bad = run_cli(write_job(tmp_path, "out2", tmp_path / "empty.csv"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (f"batchgen: error: input.path: {tmp_path / 'empty.csv'} is not a "
                                                   f"readable csv file: its first line must be a header naming every "
                                                   f"column once")


# -- OpenAI Batch requests, field by field ----------------------------------------------------------------------

def request(body: dict, url: str = "/v1/chat/completions", **top) -> dict:
    return {"custom_id": "r1", "method": "POST", "url": url, "body": body, **top}


CHAT = [{"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]


def test_a_chat_request_maps_onto_a_row():
    row = BatchEndpoint().row(request({
        "model": "gpt-4o-mini", "messages": CHAT, "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "seed": 3, "n": 2, "stop": "END", "logprobs": True, "top_logprobs": 4, "presence_penalty": 0.1,
        "frequency_penalty": 0.2, "user": "u-1", "stream": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}))
    assert row == {"custom_id": "r1", "url": "/v1/chat/completions", "model": "gpt-4o-mini",
                   "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                   "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "n": 2, "stop": ["END"],
                   "logprobs": 4, "presence_penalty": 0.1, "frequency_penalty": 0.2,
                   "json_schema": '{"type": "object"}'}


def test_a_completion_request_and_json_object():
    endpoint = BatchEndpoint()
    row = endpoint.row(request({"prompt": ["Once"], "max_tokens": 5, "logprobs": 2,
                                "response_format": {"type": "json_object"}}, url="/v1/completions"))
    assert row["prompt"] == "Once" and row["max_tokens"] == 5 and row["logprobs"] == 2
    assert row["json_schema"] == '{"type": "object"}' and "messages" not in row
    other = endpoint.row(request({"messages": CHAT}))
    assert other[INPUT_ERROR_COLUMN] == ("this batch's endpoint is /v1/completions (its first request's), not "
                                         "'/v1/chat/completions'; a batch serves one endpoint, as OpenAI's Batch "
                                         "API does")


@pytest.mark.parametrize("req,error", [
    (request({"input": "x"}, url="/v1/moderations"),
     "batchgen serves /v1/chat/completions, /v1/completions and /v1/embeddings, not '/v1/moderations'"),
    (request({"messages": CHAT}, method="GET"), "method must be POST, got 'GET'"),
    ({"method": "POST", "url": "/v1/chat/completions", "body": {"messages": CHAT}}, "custom_id must be a non-empty string"),
    (request({"messages": CHAT, "tools": [{"type": "function"}]}), "body key 'tools' is not supported (only null)"),
    (request({"messages": CHAT, "stream": True}), "body key 'stream' is not supported (only false)"),
    (request({"messages": CHAT, "logit_bias": {"1": 5}}), "body key 'logit_bias' is not supported (only null)"),
    (request({"messages": CHAT, "frobnicate": 1}), "body key 'frobnicate' is not supported"),
    (request({"messages": [{"role": "tool", "content": "x"}]}),
     "a message's role must be one of system, developer, user, assistant"),
    (request({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
     "only text content parts are supported"),
    (request({"messages": CHAT, "max_tokens": "ten"}), "max_tokens must be an integer"),
    (request({"messages": CHAT, "top_logprobs": 2}), "top_logprobs needs logprobs: true"),
    (request({"messages": CHAT, "response_format": {"type": "grammar"}}),
     "response_format type must be text, json_object or json_schema, got 'grammar'"),
    (request({"prompt": [1, 2, 3]}, url="/v1/completions"), "prompt must be a string (one prompt per request)"),
])
def test_a_request_batchgen_cannot_serve_is_that_requests_error(req, error):
    row = BatchEndpoint().row(req)
    assert row[INPUT_ERROR_COLUMN] == error
    assert row["custom_id"] == (req.get("custom_id") or None)
