"""task: embed | classify | score end to end (issue 41): `batchgen run` with real models on real Parquet, its outputs
against sentence-transformers' and transformers' own numbers; a kill -9 and resume of an embed job; an embed job
writing to s3://."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from cli_runs import kill_after_parts, read
from conftest import randomize_weights

TEXTS = [
    "The cat sat on the mat.",
    "Quantum computers use qubits, which can be in superpositions of states.",
    "I love pizza!",
    "Die Hauptstadt von Deutschland ist Berlin.",
    "naïve café résumé — “quotes” and emoji 🎉",
    " ".join(f"word{i}" for i in range(300)),  # far over all-MiniLM's 256 tokens
    "Paris is the capital of France. " * 40,  # over it too
    "",  # an error row
    "short",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
]


def write_job(root: Path, name: str, rows: dict, **job) -> Path:
    pq.write_table(pa.table(rows), root / f"{name}.parquet")
    spec = {"input": {"path": str(root / f"{name}.parquet"), "id_column": "id", **job.pop("input", {})},
            "output": {"path": str(root / f"{name}-out"), **job.pop("output", {})}, **job}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_here(job: Path, *args: str) -> None:
    """`batchgen run` in this process (torch and transformers imported once for the module's runs)."""
    result = CliRunner().invoke(main, ["run", str(job), "--quiet", *args])
    assert result.exit_code == 0, (result.output[-3000:], result.exception)


def success(out: Path) -> dict:
    return json.loads((out / "_SUCCESS").read_text())


# -- embed ------------------------------------------------------------------------------------------------------------

def embed_job(root: Path, name: str, texts: list[str], **engine) -> Path:
    return write_job(root, name, {"id": [f"r{i}" for i in range(len(texts))], "prompt": texts},
                     model="all-minilm-l6-v2", task="embed", dtype="float32", input={"sort": "length"},
                     output={"rows_per_part": 3}, engine=engine or {"max_num_seqs": 4})


def test_embed_equals_sentence_transformers(tmp_path, minilm_dir):
    from sentence_transformers import SentenceTransformer

    run_here(embed_job(tmp_path, "embed", TEXTS))
    out = tmp_path / "embed-out"
    table = read(out).sort("id", descending=False)
    rows = {row["id"]: row for row in table.iter_rows(named=True)}
    assert set(rows) == {f"r{i}" for i in range(len(TEXTS))}
    assert {"text", "finish_reason", "output_tokens", "ttft_s"}.isdisjoint(table.columns)
    assert rows["r7"]["embedding"] is None and rows["r7"]["error"] == "prompt is empty"
    st = SentenceTransformer(str(minilm_dir), device="cpu")
    ok = [i for i, text in enumerate(TEXTS) if text]
    want = st.encode([TEXTS[i] for i in ok], normalize_embeddings=True)
    for i, vector in zip(ok, want):
        got = np.array(rows[f"r{i}"]["embedding"], dtype=np.float64)
        cosine = float(got @ vector / (np.linalg.norm(got) * np.linalg.norm(vector)))
        assert cosine >= 0.9999, (i, cosine)
    longer = sum(len(st.tokenizer(TEXTS[i])["input_ids"]) > st.max_seq_length for i in ok)
    summary = success(out)
    assert longer == 2 and summary["truncated_rows"] == longer
    assert sum(rows[f"r{i}"]["num_truncated_tokens"] > 0 for i in ok) == longer
    assert summary["task"] == "embed" and summary["embedding_dimensions"] == 384 == len(want[0])
    assert summary["rows_error"] == 1 and (out / "_report.html").is_file()


@pytest.mark.slow
def test_embed_resumes_after_kill_exactly_once_and_bit_identical(tmp_path):
    texts = [f"{i}: " + " ".join(f"token{j}" for j in range(3 + i % 5 * 4)) for i in range(48)]
    # one row a batch: a row's vector does not depend on which rows a resumed run batches it with
    killed = embed_job(tmp_path, "killed", texts, max_num_seqs=1)
    spec = yaml.safe_load(killed.read_text())
    spec["output"]["rows_per_part"] = 1
    killed.write_text(yaml.safe_dump(spec))
    kill_after_parts(killed, tmp_path / "killed-out", parts=2)
    assert not (tmp_path / "killed-out" / "_SUCCESS").exists()
    run_here(killed)
    whole = embed_job(tmp_path, "whole", texts, max_num_seqs=1)
    run_here(whole)
    resumed, reference = read(tmp_path / "killed-out"), read(tmp_path / "whole-out")
    assert resumed["id"].to_list() == [f"r{i}" for i in range(len(texts))]  # every row once, in input order
    assert success(tmp_path / "killed-out")["resumed"]
    for got, want in zip(resumed["embedding"].to_list(), reference["embedding"].to_list()):
        assert np.array_equal(np.array(got, dtype=np.float32), np.array(want, dtype=np.float32))


def test_embed_to_object_storage(tmp_path):
    from s3_server import start_s3_server

    server = start_s3_server()
    try:
        server.client().create_bucket(Bucket="out")
        job = embed_job(tmp_path, "s3", TEXTS[:4])
        spec = yaml.safe_load(job.read_text())
        spec["output"]["path"] = "s3://out/embed"
        job.write_text(yaml.safe_dump(spec))
        proc = subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], capture_output=True,
                              text=True, timeout=600, env=server.env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        client = server.client()
        names = [entry["Key"] for entry in client.list_objects_v2(Bucket="out")["Contents"]]
        assert "embed/_SUCCESS" in names
        summary = json.loads(client.get_object(Bucket="out", Key="embed/_SUCCESS")["Body"].read())
        assert summary["task"] == "embed" and summary["rows_ok"] == 4 and summary["embedding_dimensions"] == 384
        part = client.get_object(Bucket="out", Key=f"embed/{summary['parts'][0]}")["Body"].read()
        table = pq.read_table(pa.BufferReader(part))
        assert table.schema.field("embedding").type == pa.list_(pa.float32())
    finally:
        server.stop()


# -- classify ---------------------------------------------------------------------------------------------------------

def random_classifier(kind: str, out: Path, tokenizer_from: Path, labels: int, seed: int) -> Path:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    names = {i: f"label_{i}" for i in range(labels)}
    common = dict(vocab_size=len(tokenizer), num_labels=labels, id2label=names,
                  label2id={name: i for i, name in names.items()})
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if kind == "bert":
        config = BertConfig(**tiny, max_position_embeddings=512, **common,
                            architectures=["BertForSequenceClassification"])
    else:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        config = LlamaConfig(**tiny, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                             pad_token_id=pad, tie_word_embeddings=False, **common,
                             architectures=["LlamaForSequenceClassification"])
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed, 0.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_classify_equals_transformers(tmp_path, kind, minilm_dir, default_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = random_classifier(kind, tmp_path / kind, minilm_dir if kind == "bert" else default_model_dir,
                                  labels=3, seed=7)
    texts = [text for text in TEXTS if text and len(text) < 400]
    job = write_job(tmp_path, "classify", {"id": list(range(len(texts))), "prompt": texts}, model=str(model_dir),
                    task="classify", dtype="float32", engine={"max_num_seqs": 4})
    run_here(job)
    rows = read(tmp_path / "classify-out").sort("id")
    summary = success(tmp_path / "classify-out")
    assert summary["labels"] == ["label_0", "label_1", "label_2"] and summary["task"] == "classify"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    for text, label, probs, score in zip(texts, rows["label"], rows["probs"], rows["score"]):
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        want = torch.softmax(logits, -1)
        assert label == f"label_{int(want.argmax())}", text
        assert np.allclose(np.array(probs), want.numpy(), atol=1e-4), (text, probs, want)
        assert score is None  # three labels: no one-output score


# -- score ------------------------------------------------------------------------------------------------------------

CONTEXTS = ["The capital of France is", "Two plus two equals ", "Once upon a time, there", "The quick brown fox",
            "Water boils at a temperature of"]
CONTINUATIONS = [" Paris.", "four", " was a princess who lived in a castle.", " jumps over the lazy dog.",
                 " 100 degrees Celsius at sea level."]


def hf_loglikelihood(model, tokenizer, context: str, continuation: str | None) -> float:
    """transformers' fp32 log-likelihood: the whole text from its second token, or lm-eval's continuation split."""
    if continuation is None:
        ids = tokenizer(context)["input_ids"]
        start = 1
    else:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tokenizer(context + continuation)["input_ids"]
        context_ids = tokenizer(context)["input_ids"]
        ids, start = context_ids + whole[len(context_ids):], len(context_ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return float(sum(logprobs[i - 1, ids[i]] for i in range(start, len(ids))))


@pytest.mark.slow
def test_score_equals_transformers(tmp_path, default_model_dir):
    """`model: default` in fp32 (a GGUF: score reads its float conversion, not the int8 one generation holds) against
    transformers on the same conversion, the whole text and with a continuation column."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    rows = {"id": list(range(len(CONTEXTS))), "prompt": CONTEXTS, "cont": CONTINUATIONS}
    for continuation in (False, True):
        name = f"score-{continuation}"
        section = {"continuation_column": "cont", "token_logprobs": True} if continuation else {}
        job = write_job(tmp_path, name, rows, model="default", task="score", dtype="float32",
                        score=section, engine={"max_num_seqs": 4, "max_model_len": 256, "kv_cache_memory": "64MiB"})
        run_here(job)
        table = read(tmp_path / f"{name}-out").sort("id")
        total = 0
        for i, row in enumerate(table.iter_rows(named=True)):
            want = hf_loglikelihood(model, tokenizer, CONTEXTS[i], CONTINUATIONS[i] if continuation else None)
            assert abs(row["logprob_sum"] - want) <= 1e-3 * abs(want), (continuation, i, row["logprob_sum"], want)
            assert math.isclose(row["perplexity"], math.exp(-row["logprob_sum"] / row["num_scored_tokens"]))
            total += row["num_scored_tokens"]
            if continuation:
                assert len(row["token_logprobs"]) == row["num_scored_tokens"]
        assert ("token_logprobs" in table.columns) == continuation
        summary = success(tmp_path / f"{name}-out")
        assert summary["scored_tokens"] == total and summary["task"] == "score"


# -- plan -------------------------------------------------------------------------------------------------------------

def test_plan_of_an_encoder_job_has_no_kv_cache(tmp_path):
    job = embed_job(tmp_path, "plan", TEXTS)
    result = CliRunner().invoke(main, ["plan", str(job)])
    assert result.exit_code == 0, result.output[-3000:]
    assert "task embed" in result.output and "no KV cache" in result.output
    assert "embeddings of 384 dimensions, mean pooling, normalized" in result.output
    assert "2 of them longer, cut to it" in result.output and "KV pool" not in result.output
