"""The prefill-only tasks on decoders (EngineArgs.task score, classify, embed): the real Engine against transformers'
own fp32 numbers, on the default model (score) and tiny random checkpoints built here (classify, embed)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen.engine import Engine, EngineArgs, PoolingParams, Request, SamplingParams, SettingError

from conftest import _TINY


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norms near 1), as conftest.save_tiny_model does for a causal LM."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def _save(model: torch.nn.Module, path: Path, seed: int) -> Path:
    _randomize(model, seed)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    labels = {0: "negative", 1: "neutral", 2: "positive"}
    config = AutoConfig.for_model("llama", **_TINY, num_labels=3, id2label=labels,
                                  label2id={v: k for k, v in labels.items()},
                                  architectures=["LlamaForSequenceClassification"])
    return _save(AutoModelForSequenceClassification.from_config(config), tmp_path_factory.mktemp("llama_cls"), 4)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model("qwen3", **_TINY, num_labels=1, architectures=["Qwen3ForSequenceClassification"])
    return _save(AutoModelForSequenceClassification.from_config(config), tmp_path_factory.mktemp("reward"), 5)


@pytest.fixture(scope="module")
def gemma3_multi_label_dir(tmp_path_factory) -> Path:
    """Gemma 3 (sliding-window layers of 8 tokens) with a four-output multi-label head: sigmoids, not a softmax."""
    from transformers import AutoModelForSequenceClassification, Gemma3TextConfig

    config = Gemma3TextConfig(**{**_TINY, "num_hidden_layers": 4}, sliding_window=8, query_pre_attn_scalar=24,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"],
                              architectures=["Gemma3TextForSequenceClassification"], num_labels=4,
                              problem_type="multi_label_classification")
    return _save(AutoModelForSequenceClassification.from_config(config), tmp_path_factory.mktemp("gemma3_cls"), 7)


@pytest.fixture(scope="module")
def qwen3_base_dir(tmp_path_factory) -> Path:
    """A Qwen3-Embedding-style checkpoint: saved from the base class (keys without `model.`, no head)."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model("qwen3", **_TINY, architectures=["Qwen3Model"])
    return _save(AutoModel.from_config(config), tmp_path_factory.mktemp("qwen3_base"), 6)


def _engine(model_dir, task: str, **overrides) -> Engine:
    return Engine(EngineArgs(model=str(model_dir), dtype="float32", task=task, kv_cache_memory="64MiB",
                             **overrides))


def _run(engine: Engine, requests: list[Request]) -> dict:
    return {result.request_id: result for result in engine.generate(requests)}


def _prompts(count: int, length: int, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length + 7 * i,), generator=generator).tolist() for i in range(count)]


# -- score -------------------------------------------------------------------------------------------------------------

def _log_likelihoods(model, ids: list[int], start: int) -> list[float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(start, len(ids))]


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert sum(got) == pytest.approx(sum(want), rel=1e-3)
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-3)


def test_score_equals_transformers_in_chunks_and_from_the_prefix_cache(default_model_dir):
    from transformers import AutoModelForCausalLM

    # 16-token steps: every prompt is prefilled in chunks; its context's full blocks are cached for the next run
    engine = _engine(default_model_dir, "score", max_num_batched_tokens=16, block_size=16)
    tok = engine.tokenizer
    text = tok.encode("The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the children "
                      "played on the grass until the evening came.")
    context = tok.encode("Question: Which city is the capital of France, the country in western Europe whose "
                         "largest city it also is? Answer:")
    yes, no = (tok.encode(answer, add_special_tokens=False) for answer in (" Paris.", " Berlin, surely."))
    first = _run(engine, [Request("text", text, SamplingParams(max_tokens=3, n=2)),
                          Request("yes", context + yes, pooling_params=PoolingParams(score_from=len(context)))])
    second = _run(engine, [Request("no", context + no, pooling_params=PoolingParams(score_from=len(context)))])
    reference = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    _close(first["text"].prompt_logprobs, _log_likelihoods(reference, text, 1))
    _close(first["yes"].prompt_logprobs, _log_likelihoods(reference, context + yes, len(context)))
    _close(second["no"].prompt_logprobs, _log_likelihoods(reference, context + no, len(context)))
    assert second["no"].cached_tokens == len(context) // 16 * 16 > 0
    for result in (*first.values(), *second.values()):
        assert (result.text, result.token_ids, result.output_tokens, result.finish_reason) == ("", [], 0, "stop")
        assert result.error is None and result.first_token_time == result.finish_time
    assert first["text"].prompt_tokens == len(text) and len(first["text"].prompt_logprobs) == len(text) - 1
    assert engine.stats()["task"] == "score" and engine.stats()["num_sampled_tokens"] == 0
    assert engine.kv_cache_manager.pool.num_in_use == 0

    bad = _run(engine, [Request("zero", text, pooling_params=PoolingParams(score_from=0)),
                        Request("end", text, pooling_params=PoolingParams(score_from=len(text))),
                        Request("long", list(text) * 200)])
    assert bad["zero"].finish_reason == bad["end"].finish_reason == "error"
    assert "score_from" in bad["zero"].error and "score_from" in bad["end"].error
    assert "too long" in bad["long"].error


# -- classify ----------------------------------------------------------------------------------------------------------

def _hf_classify(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in prompts]


def test_classify_equals_transformers(classifier_dir):
    prompts = _prompts(6, 20)
    engine = _engine(classifier_dir, "classify", max_num_batched_tokens=32, max_model_len=64)
    long_prompt = _prompts(1, 70, seed=1)[0]
    results = _run(engine, [Request(i, ids) for i, ids in enumerate(prompts)] +
                   [Request("long", long_prompt), Request("strict", long_prompt,
                                                          pooling_params=PoolingParams(truncate=False))])
    want = _hf_classify(classifier_dir, prompts + [long_prompt[:64]])
    labels = ["negative", "neutral", "positive"]
    for key, logits in zip([*range(len(prompts)), "long"], want):
        result = results[key]
        assert result.error is None and result.score is None
        assert result.label == labels[int(logits.argmax())]
        assert result.probs == pytest.approx(logits.softmax(-1).tolist(), abs=1e-4)
    assert results["long"].num_truncated_tokens == len(long_prompt) - 64 and results["long"].prompt_tokens == 64
    assert results["strict"].finish_reason == "error" and "too long" in results["strict"].error
    assert results[0].num_truncated_tokens == 0


def test_reward_model_gives_its_raw_score(reward_dir):
    prompts = _prompts(3, 12, seed=2)
    results = _run(_engine(reward_dir, "classify"), [Request(i, ids) for i, ids in enumerate(prompts)])
    for i, logits in enumerate(_hf_classify(reward_dir, prompts)):
        assert results[i].score == pytest.approx(float(logits[0]), abs=1e-4)
        assert results[i].probs == pytest.approx([float(logits[0].sigmoid())], abs=1e-4)


def test_multi_label_gemma3_classifier_in_chunks(gemma3_multi_label_dir):
    prompts = _prompts(3, 10, seed=8)
    engine = _engine(gemma3_multi_label_dir, "classify", max_num_batched_tokens=8)
    results = _run(engine, [Request(i, ids) for i, ids in enumerate(prompts)])
    for i, logits in enumerate(_hf_classify(gemma3_multi_label_dir, prompts)):
        assert results[i].probs == pytest.approx(logits.sigmoid().tolist(), abs=1e-4)
        assert results[i].label == f"LABEL_{int(logits.argmax())}" and results[i].score is None


# -- embed -------------------------------------------------------------------------------------------------------------

def _hf_hidden(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    with torch.no_grad():
        return AutoModel.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("checkpoint", ["qwen3_base_dir", "tiny_llama_dir"])
def test_embed_equals_transformers_last_hidden_state(checkpoint, request):
    model_dir = request.getfixturevalue(checkpoint)
    prompts = _prompts(2, 30, seed=3)
    engine = _engine(model_dir, "embed", max_num_batched_tokens=16)  # chunked: a mean sums over the steps
    results = _run(engine, [Request("last", prompts[0]), Request("mean", prompts[1],
                                                                 pooling_params=PoolingParams(pooling="mean")),
                            Request("cut", prompts[0], pooling_params=PoolingParams(dimensions=16, normalize=True)),
                            Request("raw", prompts[0], pooling_params=PoolingParams(normalize=False))])
    last = _hf_hidden(model_dir, prompts[0])[-1]
    mean = _hf_hidden(model_dir, prompts[1]).mean(dim=0)
    normed = torch.nn.functional.normalize
    assert results["last"].embedding == pytest.approx(normed(last, dim=0).tolist(), abs=1e-4)
    assert results["mean"].embedding == pytest.approx(normed(mean, dim=0).tolist(), abs=1e-4)
    assert results["cut"].embedding == pytest.approx(normed(last[:16], dim=0).tolist(), abs=1e-4)
    assert results["raw"].embedding == pytest.approx(last.tolist(), abs=1e-4)
    assert len(results["last"].embedding) == 64 and results["last"].text == ""


def test_embed_request_errors_name_their_field(qwen3_base_dir):
    engine = _engine(qwen3_base_dir, "embed")
    ids = _prompts(1, 10)[0]
    results = _run(engine, [Request("dims", ids, pooling_params=PoolingParams(dimensions=65)),
                            Request("cls", ids, pooling_params=PoolingParams(pooling="cls")),
                            Request("empty", [])])
    assert "dimensions" in results["dims"].error and "pooling" in results["cls"].error
    assert all(result.finish_reason == "error" for result in results.values())
    assert engine.stats()["num_results"] == 3


def test_embed_defaults_are_the_models_sentence_transformers_modules(qwen3_base_dir, tmp_path):
    """modules.json with a mean Pooling module and no Normalize one: a request leaving them None gets both."""
    import json
    import shutil

    model_dir = shutil.copytree(qwen3_base_dir, tmp_path / "st")
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    ids = _prompts(1, 12, seed=9)[0]
    results = _run(_engine(model_dir, "embed"), [Request(0, ids)])
    assert results[0].embedding == pytest.approx(_hf_hidden(qwen3_base_dir, ids).mean(dim=0).tolist(), abs=1e-4)


# -- refusals at start, and the generic path ---------------------------------------------------------------------------

def test_a_model_without_the_task_head_is_refused_at_start(tiny_llama_dir, classifier_dir, qwen3_base_dir):
    for model_dir, task, words in ((tiny_llama_dir, "classify", "LlamaForCausalLM"),
                                   (classifier_dir, "generate", "LlamaForSequenceClassification"),
                                   (qwen3_base_dir, "score", "Qwen3Model"),
                                   (classifier_dir, "classify", "generic path")):
        impl = "transformers" if words == "generic path" else "auto"
        with pytest.raises(SettingError) as raised:
            _engine(model_dir, task, model_impl=impl)
        assert raised.value.key == "task" and words in str(raised.value), str(raised.value)


def test_score_and_embed_on_the_generic_path(tiny_llama_dir):
    ids = _prompts(1, 24, seed=4)[0]
    native = _run(_engine(tiny_llama_dir, "score"), [Request(0, ids, pooling_params=PoolingParams(score_from=5))])
    generic = _run(_engine(tiny_llama_dir, "score", model_impl="transformers"),
                   [Request(0, ids, pooling_params=PoolingParams(score_from=5))])
    assert generic[0].prompt_logprobs == pytest.approx(native[0].prompt_logprobs, abs=1e-4)
    embedded = _run(_engine(tiny_llama_dir, "embed", model_impl="transformers"), [Request(0, ids)])
    last = _hf_hidden(tiny_llama_dir, ids)[-1]
    assert embedded[0].embedding == pytest.approx(torch.nn.functional.normalize(last, dim=0).tolist(), abs=1e-4)
