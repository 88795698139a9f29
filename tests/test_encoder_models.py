"""The encoder models against their references: the native BERT path against sentence-transformers on the real
all-MiniLM-L6-v2 (fp32 and bf16, rows past its 256-token limit included), tiny random classification heads against
transformers, the generic path (MPNet, ModernBERT) against transformers, and a sentence-transformers layout with
cls pooling and a Dense layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.engine import EngineArgs, PoolingParams, Request, open_engine
from batchgen.models.encoder_support import describe_encoder, is_encoder_model

from encoder_cases import random_rows, save_tiny_encoder

WORDS = ("the quick brown fox jumps over a lazy dog while batch engines embed sentences into vectors, and "
         "cosine similarity compares them; naïve café résumé 東京 emoji 🙂 numbers 3.14159 and URLs "
         "https://example.com/a?b=c").split()


def texts() -> list[str]:
    generator = torch.Generator().manual_seed(0)
    out = ["hello", "A short sentence.", "?", " ".join(WORDS)]
    for n in (5, 40, 200, 400):  # past 256 tokens too: cut the tokenizer's way
        picks = torch.randint(0, len(WORDS), (n,), generator=generator).tolist()
        out.append(" ".join(WORDS[i] for i in picks))
    return out


def embed(engine, rows, params=None) -> dict:
    return {r.request_id: r for r in engine.generate(Request(i, row, pooling_params=params)
                                                     for i, row in enumerate(rows))}


@pytest.fixture(scope="module")
def minilm_reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    return model.encode(texts(), batch_size=4, convert_to_tensor=True, normalize_embeddings=True).float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_bert_matches_sentence_transformers(minilm_dir, minilm_reference, dtype):
    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 on this CPU")
    engine = open_engine(EngineArgs(model="all-minilm-l6-v2", task="embed", dtype=dtype, max_num_batched_tokens=700))
    assert engine.plan.path == "native" and engine.max_model_len == 256
    rows = [engine.tokenizer.encode(text) for text in texts()]
    results = embed(engine, rows)
    got = torch.tensor([results[i].embedding for i in range(len(rows))])
    cosine = F.cosine_similarity(got, minilm_reference, dim=-1)
    assert cosine.min() >= 0.9999, cosine
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(rows)), atol=1e-5)
    for i, row in enumerate(rows):
        assert results[i].num_truncated_tokens == max(0, len(row) - 256)
        assert results[i].prompt_tokens == min(len(row), 256)
    assert any(len(row) > 256 for row in rows)


def test_minilm_description(minilm_dir, tiny_llama_dir):
    description = describe_encoder(minilm_dir)
    assert is_encoder_model("all-minilm-l6-v2") and not is_encoder_model(str(tiny_llama_dir))
    assert (description.pooling, description.normalize, description.max_length) == ("mean", True, 256)
    assert description.embedding_dimension == 384 and description.native and not description.has_classifier
    assert 22_000_000 < description.parameters < 23_000_000


@pytest.mark.parametrize("model_type,architecture,path", [
    ("bert", "BertForSequenceClassification", "native"), ("roberta", "RobertaForSequenceClassification", "native"),
    ("xlm-roberta", "XLMRobertaForSequenceClassification", "native"),
    ("mpnet", "MPNetForSequenceClassification", "generic")])
def test_classification_heads_match_transformers(tmp_path, minilm_dir, model_type, architecture, path):
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    model = save_tiny_encoder(tmp_path, model_type, architecture, minilm_dir, num_labels=3, id2label=labels,
                              label2id={v: k for k, v in labels.items()})
    engine = open_engine(EngineArgs(model=str(tmp_path), task="classify", dtype="float32"))
    assert engine.plan.path == path
    rows = random_rows(6, 2, 60, seed=3)
    results = embed(engine, rows)
    for i, row in enumerate(rows):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([row])).logits[0]
        probs = torch.softmax(logits, -1)
        assert results[i].label == labels[int(probs.argmax())]
        assert torch.allclose(torch.tensor(results[i].probs), probs, atol=1e-4)
        assert results[i].score is None and results[i].embedding is None


def test_one_output_and_multi_label_heads(tmp_path, minilm_dir):
    model = save_tiny_encoder(tmp_path / "one", "bert", "BertForSequenceClassification", minilm_dir, num_labels=1)
    rows = random_rows(4, 3, 20, seed=4)
    results = embed(open_engine(EngineArgs(model=str(tmp_path / "one"), task="classify", dtype="float32")), rows)
    for i, row in enumerate(rows):
        with torch.no_grad():
            raw = model(input_ids=torch.tensor([row])).logits[0, 0]
        assert results[i].score == pytest.approx(float(raw), abs=1e-4)
        assert results[i].probs == pytest.approx([float(torch.sigmoid(raw))], abs=1e-4)
    model = save_tiny_encoder(tmp_path / "multi", "bert", "BertForSequenceClassification", minilm_dir, num_labels=4,
                              problem_type="multi_label_classification")
    results = embed(open_engine(EngineArgs(model=str(tmp_path / "multi"), task="classify", dtype="float32")), rows)
    for i, row in enumerate(rows):
        with torch.no_grad():
            probs = torch.sigmoid(model(input_ids=torch.tensor([row])).logits[0])
        assert torch.allclose(torch.tensor(results[i].probs), probs, atol=1e-4)
        assert results[i].label == f"LABEL_{int(probs.argmax())}"


@pytest.mark.parametrize("model_type,architecture,fields", [
    ("mpnet", "MPNetModel", {}),
    ("modernbert", "ModernBertModel", dict(pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101,
                                           sep_token_id=102, global_attn_every_n_layers=2, local_attention=16)),
    ("distilbert", "DistilBertModel", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64)),
])
def test_generic_encoders_match_transformers(tmp_path, minilm_dir, model_type, architecture, fields):
    model = save_tiny_encoder(tmp_path, model_type, architecture, minilm_dir, **fields)
    engine = open_engine(EngineArgs(model=str(tmp_path), task="embed", dtype="float32"))
    assert engine.plan.path == "generic"
    rows = random_rows(6, 2, 50, seed=5)
    results = embed(engine, rows, PoolingParams(normalize=False))
    for i, row in enumerate(rows):
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([row])).last_hidden_state[0]
        assert torch.allclose(torch.tensor(results[i].embedding), hidden.mean(0), atol=1e-4)
    cls = embed(engine, rows[:2], PoolingParams(pooling="cls", normalize=False))
    with torch.no_grad():
        first = model(input_ids=torch.tensor([rows[0]])).last_hidden_state[0, 0]
    assert torch.allclose(torch.tensor(cls[0].embedding), first, atol=1e-4)


def test_sentence_transformers_layout_cls_dense(tmp_path, minilm_dir):
    """cls pooling, a Dense layer (tanh) and Normalize, as sentence-transformers saves them, and Matryoshka cuts."""
    from sentence_transformers import SentenceTransformer, models

    save_tiny_encoder(tmp_path / "base", "bert", "BertModel", minilm_dir)
    torch.manual_seed(0)
    modules = [models.Transformer(str(tmp_path / "base"), max_seq_length=40), models.Pooling(32, "cls"),
               models.Dense(32, 24, activation_function=torch.nn.Tanh()), models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    reference = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    description = describe_encoder(tmp_path / "st")
    assert (description.pooling, description.normalize, description.max_length) == ("cls", True, 40)
    assert [(d.in_features, d.out_features, d.activation) for d in description.dense_layers] == [(32, 24, "tanh")]
    engine = open_engine(EngineArgs(model=str(tmp_path / "st"), task="embed", dtype="float32"))
    sentences = ["a b c", "hello there, how are you today", " ".join(["word"] * 60)]
    rows = [engine.tokenizer.encode(s) for s in sentences]
    got = embed(engine, rows)
    want = reference.encode(sentences, convert_to_tensor=True, normalize_embeddings=True)
    for i in range(len(rows)):
        assert len(got[i].embedding) == 24
        assert F.cosine_similarity(torch.tensor(got[i].embedding), want[i], dim=0) >= 0.9999
    cut = embed(engine, rows, PoolingParams(dimensions=8))
    raw = embed(engine, rows, PoolingParams(normalize=False))
    for i in range(len(rows)):
        assert torch.allclose(torch.tensor(cut[i].embedding), F.normalize(torch.tensor(raw[i].embedding[:8]), dim=0),
                              atol=1e-6)


def test_wheel_model_extracted_once_under_a_race(tmp_path, monkeypatch):
    """A zipped model directory in a package is extracted once into the cache; two extractions at once leave one
    entry and no temp directory; a missing package names the install command."""
    import threading
    import zipfile

    from batchgen.models.registry import ModelNotFoundError
    from batchgen.models.wheel_models import WheelModel

    package = tmp_path / "site" / "fake_encoder_wheel"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    with zipfile.ZipFile(package / "model.zip", "w") as zipped:
        zipped.writestr("config.json", '{"model_type": "bert"}')
        zipped.writestr("1_Pooling/config.json", "{}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    wheel = WheelModel("fake_encoder_wheel", "pip install fake==1", "model.zip", "fake")
    found = []
    threads = [threading.Thread(target=lambda: found.append(wheel.model_dir("fake"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(found)) == 1 and len(found) == 4
    assert (found[0] / "1_Pooling" / "config.json").is_file()
    assert [p.name for p in (tmp_path / "cache" / "named").iterdir()] == [found[0].name]
    with pytest.raises(ModelNotFoundError, match="pip install fake==1"):
        WheelModel("no_such_package_here", "pip install fake==1", "model.zip", "x").model_dir("x")


def test_generic_path_grouped_by_length_is_batch_invariant(tmp_path, minilm_dir):
    """engine.batch_invariant on the generic path: each run of one length is its own unpadded call."""
    save_tiny_encoder(tmp_path, "mpnet", "MPNetModel", minilm_dir)
    engine = open_engine(EngineArgs(model=str(tmp_path), task="embed", dtype="float32", batch_invariant=True))
    rows = random_rows(8, 4, 30, seed=6)
    rows.append(rows[2][:])
    together = embed(engine, rows)
    for i in (0, 2, 8):
        engine.add_request(Request(("alone", i), rows[i]))
        assert engine.step()[0].embedding == together[i].embedding
