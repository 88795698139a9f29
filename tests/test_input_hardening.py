"""Inputs that used to sink a whole run or mislead it (issue 38), each through the real CLI: a byte that is not UTF-8
is its line's error (run-batch, JSON lines, CSV) naming the line; a custom_id that is not a string is that request's
error, its output line carrying the custom_id as given; a custom_id twice is refused before the model loads; a
Hugging Face cache entry whose config.json links to a missing blob is called damaged; a prompt of megabytes is its
row's error before it is tokenized, the run's peak memory stays under its bound, and the summary's prefix-cache share
is of the prompt tokens of the same rows."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from cli_runs import read, run_cli

NOT_UTF8 = b"caf\xe9"  # Latin-1's é: not UTF-8


def batchgen(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True, timeout=900,
                          env=env)


def completion(custom_id, prompt: str = "Count to three.") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 1, "temperature": 0}}).encode()


def run_batch(tmp_path: Path, lines: list[bytes]) -> subprocess.CompletedProcess:
    (tmp_path / "requests.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return batchgen("run-batch", "-i", str(tmp_path / "requests.jsonl"), "-o", str(tmp_path / "results.jsonl"),
                    "--set", "dtype=float32", "--quiet")


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_job(tmp_path: Path, input_path: Path, **keys) -> Path:
    job = {"model": "default", "dtype": "float32", "input": {"path": str(input_path), **keys.pop("input", {})},
           "sampling": {"max_tokens": 1}, "output": {"path": str(tmp_path / "out")}, **keys}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


# -- 1 and 2: a line not UTF-8, a custom_id that is not a string: that request's error, the others answered ----------

def test_run_batch_answers_around_a_line_not_utf8_and_a_numeric_custom_id(tmp_path):
    blank = [b""] * 28  # lines 3-30: blank lines count as lines, so the bad byte is on line 31 with few requests
    lines = [completion("a"), completion(17), *blank, completion("bad", "Say caf\xe9.").replace(b"\\u00e9", b"\xe9"),
             completion("b")]
    bad_at = lines[30].index(NOT_UTF8) + len(b"caf") + 1  # counted from 1, as an editor's column
    done = run_batch(tmp_path, lines)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["custom_id"] for r in json_lines(tmp_path / "results.jsonl")] == ["a", "b"]
    errors = {e["custom_id"]: e["response"]["body"]["error"]["message"]
              for e in json_lines(tmp_path / "results.errors.jsonl")}
    assert errors == {"17": "line 2: custom_id must be a non-empty string, got 17",
                      "bad": f"line 31 is not UTF-8 (invalid continuation byte at byte {bad_at})"}


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_line_not_utf8_is_that_rows_error_in_a_run(tmp_path, fmt):
    if fmt == "jsonl":
        text = b"".join(json.dumps({"id": i, "prompt": p}).encode().replace(b"\\u00e9", b"\xe9") + b"\n"
                        for i, p in [(1, "Count to three."), (2, "Say caf\xe9."), (3, "Name a colour.")])
        at = text.splitlines()[1].index(NOT_UTF8) + len(b"caf") + 1
        where = f"line 2 is not UTF-8 (invalid continuation byte at byte {at})"
    else:  # the bad byte on line 4, the second line of a quoted field: the record is that row
        text = b'id,prompt\n1,Count to three.\n2,"Say\n' + NOT_UTF8 + b'."\n3,Name a colour.\n'
        where = "line 4 is not UTF-8 (invalid continuation byte at byte 4)"
    (tmp_path / f"in.{fmt}").write_bytes(text)
    done = run_cli(write_job(tmp_path, tmp_path / f"in.{fmt}", input={"id_column": "id"}))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read(tmp_path / "out").sort("id")
    assert rows["id"].to_list() == [1, 2, 3]  # the bad row keeps its id
    assert rows["error"].to_list() == [None, where, None]
    assert rows["output_tokens"].to_list() == [1, 0, 1]


# -- 3: a custom_id twice ---------------------------------------------------------------------------------------------

def test_a_custom_id_twice_is_refused_before_the_model_loads(tmp_path):
    requests = [completion("a"), completion("b"), b"", completion("c"), completion("b")]
    done = run_batch(tmp_path, requests)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"batchgen: error: input.path: {tmp_path / 'requests.jsonl'}: custom_id 'b' is on lines 2 and 5; a batch "
        f"holds each custom_id once, as OpenAI's Batch API requires (the results are matched to the requests by it)"]
    assert not (tmp_path / "results.jsonl").exists() and not (tmp_path / "results.jsonl.batchgen").exists()
    job = write_job(tmp_path, tmp_path / "requests.jsonl", input={"format": "openai-batch"})
    done = batchgen("plan", str(job))  # plan reads the input as run does
    assert done.returncode == 2 and "custom_id 'b' is on lines 2 and 5" in done.stderr, done.stderr[-2000:]
    done = run_cli(job)
    assert done.returncode == 2 and "custom_id 'b' is on lines 2 and 5" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


# -- 4: a damaged Hugging Face cache entry ----------------------------------------------------------------------------

def test_a_config_linked_to_a_missing_blob_is_a_damaged_cache_entry(tmp_path):
    repo = tmp_path / "hf" / "hub" / "models--org--name"
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "abcd")
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (snapshot / "config.json").symlink_to("../../blobs/missing")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    (tmp_path / "in.jsonl").write_text('{"prompt": "Hi"}\n')
    job = write_job(tmp_path, tmp_path / "in.jsonl", model="org/name")
    for variable, value in [("HF_HOME", tmp_path / "hf"), ("HF_HUB_CACHE", tmp_path / "hf" / "hub")]:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE")}
        done = batchgen("plan", str(job), env={**env, variable: str(value), "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 2
        assert done.stderr.strip().splitlines() == [
            f"batchgen: error: model: 'org/name' is damaged in the Hugging Face cache: {snapshot / 'config.json'} "
            f"links to ../../blobs/missing, which does not exist (a download cut short, or a blob deleted); delete "
            f"{snapshot} and download it again; HF_HUB_OFFLINE=1 forbids downloading it"], done.stderr


# -- 5: a prompt of megabytes -----------------------------------------------------------------------------------------

INSTRUCTION = "You label product reviews as positive or negative. Answer with one word. " * 4


def test_a_ten_megabyte_prompt_is_its_rows_error_and_memory_stays_bounded(tmp_path):
    """Rows sharing a long instruction (prefix-cache hits), one prompt too long for engine.max_model_len 256 (an error
    row with its tokens counted) and one of 10 MB (refused untokenized); the summary's share adds up."""
    huge = "word " * 2_000_000
    prompts = [INSTRUCTION + "Review: great.", huge, INSTRUCTION + "Review: awful.", "many words " * 150,
               INSTRUCTION + "Review: fine."]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                                               for i, p in enumerate(prompts)))
    job = write_job(tmp_path, tmp_path / "in.jsonl", input={"id_column": "id", "chat_template": False},
                    engine={"max_model_len": 256, "kv_cache_memory": "16MiB"})
    done = batchgen("run", str(job))  # not quiet: the summary
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read(tmp_path / "out").sort("id")
    assert rows["error"][1] == ("prompt is 10,000,000 characters, more than the context of 256 tokens could hold "
                                "(at most 32 characters a token); it was not tokenized")
    assert rows["prompt_tokens"][1] == 0 and rows["error"][3].startswith("prompt is too long: ")
    assert rows.filter(pl.col("error").is_null())["id"].to_list() == [0, 2, 4]
    summary = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert summary["peak_memory_bytes"] <= summary["memory_bound_bytes"], summary
    ok = rows.filter(pl.col("error").is_null())
    assert summary["generated_prompt_tokens"] == ok["prompt_tokens"].sum() < summary["prompt_tokens"]
    assert summary["cached_tokens"] == ok["cached_tokens"].sum() > 0
    line = next(line for line in done.stderr.splitlines() if "prompt tokens" in line)
    numbers = re.search(r"prompt tokens\s+([\d,]+) of the rows generated \(([\d,]+) from the prefix cache, "
                        r"([\d.]+)%\), ([\d,]+) of error rows", line)
    assert numbers, line
    generated, cached, share, errors = (float(n.replace(",", "")) for n in numbers.groups())
    assert (generated, cached) == (summary["generated_prompt_tokens"], summary["cached_tokens"])
    assert generated + errors == summary["prompt_tokens"]
    assert share == pytest.approx(100 * cached / generated, abs=0.05)
