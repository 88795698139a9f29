"""`batchgen run-batch` on `/v1/embeddings` requests: the job runs task embed on all-MiniLM, each answered line is
OpenAI's embeddings response (float or base64), equal to sentence-transformers' embedding, and a request it cannot
serve is a line of the errors file."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.job import parse_job
from batchgen.job.run_batch import batch_job

EMBEDDINGS = "/v1/embeddings"
LONG = " ".join(f"Sentence number {i} of a long report about the harbour, the bridge and the orchard."
                for i in range(40))
TEXTS = {"short": "The quick brown fox jumps over the lazy dog.",
         "medium": "Review of the espresso machine: Exceeded my expectations. The build quality feels premium.",
         "long": LONG}  # about 700 tokens: cut to the model's 256, as sentence-transformers cuts it


def request(custom_id: str, body: dict, url: str = EMBEDDINGS) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_requests(path, requests: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return str(path)


def run_batch(tmp_path, requests: list[dict]) -> tuple[dict, dict]:
    source = write_requests(tmp_path / "requests.jsonl", requests)
    results = tmp_path / "results.jsonl"
    outcome = CliRunner().invoke(main, ["run-batch", "-i", source, "-o", str(results), "--model", "all-minilm-l6-v2",
                                        "--quiet"])
    assert outcome.exit_code == 0, outcome.output
    answered = {line["custom_id"]: line for line in map(json.loads, results.read_text().splitlines())}
    errors_file = tmp_path / "results.errors.jsonl"
    failed = {line["custom_id"]: line for line in map(json.loads, errors_file.read_text().splitlines())} \
        if errors_file.is_file() else {}
    return answered, failed


def vector(body: dict) -> np.ndarray:
    encoded = body["data"][0]["embedding"]
    if isinstance(encoded, str):
        return np.frombuffer(base64.b64decode(encoded), dtype="<f4").astype(np.float64)
    return np.asarray(encoded, dtype=np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    return dict(zip(TEXTS, model.encode(list(TEXTS.values()), convert_to_numpy=True).astype(np.float64)))


def test_run_batch_picks_task_embed_for_an_embeddings_file(tmp_path):
    embeddings = write_requests(tmp_path / "e.jsonl", [request("a", {"model": "m", "input": "hello"})])
    job = parse_job(batch_job(embeddings, str(tmp_path / "out.jsonl"), "all-minilm-l6-v2"))
    assert job.task == "embed" and {"encoding_format", "dimensions", "url"} <= set(job.output.keep_columns)
    chat = write_requests(tmp_path / "c.jsonl", [request("a", {"messages": [{"role": "user", "content": "hi"}]},
                                                         "/v1/chat/completions")])
    assert parse_job(batch_job(chat, str(tmp_path / "out.jsonl"), "default")).task == "generate"


def test_embeddings_as_openai_answers_them(tmp_path, reference):
    requests = [request("short", {"model": "text-embedding-3-small", "input": TEXTS["short"], "user": "u1"}),
                request("medium", {"model": "m", "input": [TEXTS["medium"]], "encoding_format": "base64"}),
                request("long", {"model": "m", "input": TEXTS["long"], "encoding_format": "float"}),
                request("cut", {"model": "m", "input": TEXTS["short"], "dimensions": 128}),
                request("several", {"model": "m", "input": ["one", "two"]}),
                request("format", {"model": "m", "input": "x", "encoding_format": "int8"}),
                request("empty", {"model": "m", "input": ""}),
                request("chat", {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")]
    answered, failed = run_batch(tmp_path, requests)
    assert set(answered) == {"short", "medium", "long", "cut"}
    assert set(failed) == {"several", "format", "empty", "chat"}
    for name in ("short", "medium", "long"):
        line = answered[name]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        body = line["response"]["body"]
        assert body["object"] == "list" and body["model"] == "all-minilm-l6-v2"
        assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0)]
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        assert cosine(vector(body), reference[name]) >= 0.9999, name
        assert abs(np.linalg.norm(vector(body)) - 1.0) < 1e-5  # all-MiniLM normalizes
    assert isinstance(answered["medium"]["response"]["body"]["data"][0]["embedding"], str)  # base64
    assert isinstance(answered["long"]["response"]["body"]["data"][0]["embedding"], list)
    assert answered["long"]["response"]["body"]["usage"]["prompt_tokens"] == 256  # the tokens the model ran
    cut = vector(answered["cut"]["response"]["body"])
    assert cut.shape == (128,) and cosine(cut, reference["short"][:128]) >= 0.9999
    assert abs(np.linalg.norm(cut) - 1.0) < 1e-5
    messages = {name: line["response"]["body"]["error"]["message"] for name, line in failed.items()}
    assert "one input per request line" in messages["several"]
    assert "encoding_format must be float or base64" in messages["format"]
    assert "input must not be empty" in messages["empty"]
    assert "this batch's endpoint is /v1/embeddings" in messages["chat"]
    assert all(line["response"]["status_code"] == 400 for line in failed.values())


def test_token_ids_input(tmp_path, reference, minilm_dir):
    """A list of token ids embeds those tokens as they are (the tokenizer's own, special tokens included)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(minilm_dir)(TEXTS["short"])["input_ids"]
    answered, failed = run_batch(tmp_path, [request("ids", {"model": "m", "input": ids}),
                                            request("negative", {"model": "m", "input": [101, -1, 102]})])
    assert set(failed) == {"negative"} and set(answered) == {"ids"}
    body = answered["ids"]["response"]["body"]
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert cosine(vector(body), reference["short"]) >= 0.9999
