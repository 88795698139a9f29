"""output.format jsonl and openai-batch, and `batchgen run-batch`: real runs of the default model. The OpenAI Batch
output, field by field against the published shape (a line per request: id, custom_id, response {status_code,
request_id, body {id, object, created, model, choices, usage}}, error; failed requests in the error file with a 400
body), n samples as choices, logprobs, response_format; run-batch writes -o and the errors file whole, resumes after
kill -9 with every custom_id exactly once, and its JSON lines equal the Parquet output's rows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from cli_runs import kill_after_parts

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = pl.read_parquet(ROOT / "data" / "samples" / "prompts.parquet")


def batchgen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True, timeout=900)


def chat_requests(count: int, **body) -> list[dict]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "any-name", "messages": [{"role": "user", "content": prompt}], "max_tokens": 10,
                      "temperature": 0, **body}}
            for i, prompt in enumerate(PROMPTS["prompt"].head(count))]


def write_lines(path: Path, items: list) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def answered(tmp_path_factory) -> Path:
    """run-batch over 12 chat requests (two of them asking n=2 and JSON), a line that is not JSON and an embeddings
    request."""
    tmp = tmp_path_factory.mktemp("run_batch")
    requests = chat_requests(12)
    requests[3]["body"] |= {"n": 2, "temperature": 0.8, "seed": 7}
    requests[5]["body"] |= {"response_format": {"type": "json_object"}, "max_tokens": 40}
    requests[7]["body"] |= {"logprobs": True, "top_logprobs": 2}
    write_lines(tmp / "requests.jsonl", requests + ["{not json", {"custom_id": "emb", "method": "POST",
                                                                    "url": "/v1/embeddings", "body": {"input": "x"}}])
    done = batchgen("run-batch", "-i", str(tmp / "requests.jsonl"), "-o", str(tmp / "results.jsonl"),
                    "--set", "dtype=float32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (f"batchgen: wrote {tmp / 'results.jsonl'} and "
                                                    f"{tmp / 'results.errors.jsonl'}")
    return tmp


def test_each_answered_request_is_one_line_in_openai_batch_form(answered):
    results = lines(answered / "results.jsonl")
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(12)]  # in input order
    for r in results:
        assert set(r) == {"id", "custom_id", "response", "error", "batchgen"} and r["error"] is None
        assert r["id"].startswith("batch_req_") and set(r["response"]) == {"status_code", "request_id", "body"}
        assert r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "default"
        assert isinstance(body["created"], int)
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0
        for index, choice in enumerate(body["choices"]):
            assert choice["index"] == index and choice["message"]["role"] == "assistant"
            assert choice["finish_reason"] in ("stop", "length")
        assert {"queue_s", "ttft_s", "e2e_s", "finish_time"} <= set(r["batchgen"])
    assert len(results[3]["response"]["body"]["choices"]) == 2  # n=2: one request, two choices
    constrained = results[5]["response"]["body"]["choices"][0]  # response_format json_object: a JSON object
    assert constrained["message"]["content"].lstrip().startswith("{")
    if constrained["finish_reason"] == "stop":
        assert isinstance(json.loads(constrained["message"]["content"]), dict)
    content = results[7]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == results[7]["response"]["body"]["usage"]["completion_tokens"]
    assert all(len(token["top_logprobs"]) == 2 and token["token"] == token["top_logprobs"][0]["token"]
               for token in content)  # greedy: the sampled token is the likeliest


def test_failed_requests_go_to_the_error_file(answered):
    errors = lines(answered / "results.errors.jsonl")
    assert [e["custom_id"] for e in errors] == [None, "emb"]
    for e in errors:
        assert e["error"] is None and e["response"]["status_code"] == 400
        assert set(e["response"]["body"]["error"]) == {"message", "type", "param", "code"}
    assert errors[0]["response"]["body"]["error"]["message"].startswith("line 13 is not JSON")
    assert "not '/v1/embeddings'" in errors[1]["response"]["body"]["error"]["message"]


def test_the_same_command_again_rewrites_the_results_from_the_finished_job(answered):
    before = (answered / "results.jsonl").read_bytes()
    (answered / "results.jsonl").unlink()
    again = batchgen("run-batch", "-i", str(answered / "requests.jsonl"), "-o", str(answered / "results.jsonl"),
                     "--set", "dtype=float32")
    assert again.returncode == 0 and "is already complete (14 rows)" in again.stderr, again.stderr[-2000:]
    assert (answered / "results.jsonl").read_bytes() == before


def test_batchgen_report_reads_an_openai_batch_output_back_to_the_same_page(answered):
    work = answered / "results.jsonl.batchgen"
    drawn = (work / "_report.html").read_text()  # drawn at the finish, from the output tables
    again = batchgen("report", str(work), "-o", str(answered / "again.html"))
    assert again.returncode == 0, again.stderr[-2000:]
    redrawn = (answered / "again.html").read_text()  # from the OpenAI Batch lines and their `batchgen` objects
    assert "ms</td>" in drawn and "14</td>" in drawn  # latencies and the row count: a page with figures
    assert redrawn.split("<footer>")[0] == drawn.split("<footer>")[0]


def test_a_request_without_max_tokens_generates_until_the_context_ends(tmp_path):
    """As OpenAI's and vLLM's endpoints: no max_tokens is the rest of the context (here engine.max_model_len 64),
    not the job default of 256; and plan bounds such a row's output by its context."""
    requests = chat_requests(2, temperature=0)
    for request in requests:
        del request["body"]["max_tokens"]
        request["body"]["messages"][0]["content"] = "Write a long story about a lighthouse keeper."
    write_lines(tmp_path / "requests.jsonl", requests)
    done = batchgen("run-batch", "-i", str(tmp_path / "requests.jsonl"), "-o", str(tmp_path / "results.jsonl"),
                    "--set", "dtype=float32", "--set", "engine.max_model_len=64")
    assert done.returncode == 0, done.stderr[-3000:]
    for line in lines(tmp_path / "results.jsonl"):
        body = line["response"]["body"]
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["total_tokens"] == 64, body
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": "default", "input": {"path": str(tmp_path / "requests.jsonl"),
                                                                 "format": "openai-batch"},
                                   "sampling": {"max_tokens": None}, "engine": {"max_model_len": 64},
                                   "output": {"path": str(tmp_path / "out")}}))
    planned = batchgen("plan", str(job))
    prompts = [line["response"]["body"]["usage"]["prompt_tokens"] for line in lines(tmp_path / "results.jsonl")]
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert f"output tokens: at most {sum(64 - p for p in prompts):,} " in planned.stdout, planned.stdout


@pytest.mark.slow
def test_run_batch_killed_and_resumed_answers_every_custom_id_once(tmp_path):
    requests = write_lines(tmp_path / "requests.jsonl", chat_requests(16))
    args = ["-i", str(requests), "-o", str(tmp_path / "results.jsonl"), "--set", "dtype=float32",
            "--set", "output.rows_per_part=2", "--set", "engine.max_num_seqs=2"]
    kill_after_parts(["run-batch", *args], tmp_path / "results.jsonl.batchgen", 3)
    assert not (tmp_path / "results.jsonl").exists()
    done = batchgen("run-batch", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = [r["custom_id"] for r in lines(tmp_path / "results.jsonl")]
    assert ids == [f"req-{i}" for i in range(16)]  # each once, in input order
    summary = json.loads((tmp_path / "results.jsonl.batchgen" / "_SUCCESS").read_text())
    assert summary["resumed"] and 0 < summary["rows_this_run"] < 16


def test_jsonl_output_holds_the_parquet_outputs_rows(tmp_path):
    job = yaml.safe_load((ROOT / "jobs" / "sample.yaml").read_text())
    job["input"]["path"] = str(ROOT / job["input"]["path"])
    job["dtype"], job["sampling"]["max_tokens"] = "float32", 8
    for fmt in ("parquet", "jsonl"):
        job["output"] = {**job["output"], "path": str(tmp_path / fmt), "format": fmt, "rows_per_part": 16}
        (tmp_path / f"{fmt}.yaml").write_text(yaml.safe_dump(job))
        assert batchgen("run", str(tmp_path / f"{fmt}.yaml"), "--quiet").returncode == 0
    parquet = pl.read_parquet(f"{tmp_path / 'parquet'}/*.parquet")
    names = sorted(p.name for p in (tmp_path / "jsonl").iterdir())
    assert names == ["_SUCCESS", "_report.html", "_timeline.json", "part-00000.jsonl", "part-00001.jsonl"]
    rows = [row for name in names[3:] for row in lines(tmp_path / "jsonl" / name)]
    assert list(rows[0]) == parquet.columns  # the output columns, in order
    for column in ("id", "text", "finish_reason", "prompt_tokens", "output_tokens", "topic"):
        assert [row[column] for row in rows] == parquet[column].to_list()
    summary = json.loads((tmp_path / "jsonl" / "_SUCCESS").read_text())
    assert summary["parts"] == ["part-00000.jsonl", "part-00001.jsonl"]
    again = batchgen("run", str(tmp_path / "jsonl.yaml"), "--quiet", "--overwrite", "--set", "output.format=parquet")
    assert again.returncode == 0 and not list((tmp_path / "jsonl").glob("*.jsonl"))  # batchgen's, so removed
    (tmp_path / "jsonl" / "notes.jsonl").write_text("{}\n")
    refused = batchgen("run", str(tmp_path / "jsonl.yaml"), "--quiet", "--overwrite")
    assert refused.returncode == 2 and "notes.jsonl" in refused.stderr
