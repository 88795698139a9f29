"""The engine on the real default model (SmolLM2-135M-Instruct, held in int8 from its GGUF) against transformers'
greedy generation of the same GGUF with the same int8 weights (test_gguf_quantized.py's int8 reference and rule:
transformers' dequantized weights requantized as the conversion does; the engine in fp32 with weight-only int8, so
that only the order of fp32 sums differs)."""
from unittest import mock

import pytest

from batchgen.bench.greedy_check import assert_greedy_matches, hf_greedy
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.models import loader
from batchgen.models.named import NAMED_MODELS
from batchgen.models.quantization import Int8Linear
from test_gguf_quantized import int8_reference

MAX_TOKENS = 40
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "Translate into French: 'The weather is nice today and I am going for a walk.'"}],
    [{"role": "user", "content": "List three uses of a paperclip."}],
    [{"role": "user", "content": "What is 17 times 23? Show your working."}],
    [{"role": "system", "content": "Classify the sentiment of the review as positive, negative or neutral."},
     {"role": "user", "content": "The battery died after two days and support never answered my emails."}],
    [{"role": "user", "content": "Explain what a hash table is to a ten-year-old, in a short paragraph, "
                                 "with an example about a library and its books, and mention collisions."}],
    [{"role": "user", "content": "hi"}],
]


@pytest.fixture(scope="module")
def setup(default_int8_dir):
    with mock.patch.dict(loader.INT8_OPTIONS, {"activations": "weight_only"}):
        engine = Engine(EngineArgs(model=str(default_int8_dir), dtype="float32", kv_cache_memory="256MiB",
                                   max_num_seqs=32))
    assert isinstance(engine.model.model.layers[0].self_attn.qkv_proj, Int8Linear)
    hf = int8_reference(NAMED_MODELS["default"].gguf("default"))
    prompts = [engine.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
               for c in CONVERSATIONS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    references = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return engine, hf, prompts, references


def test_default_model_greedy_matches_transformers(setup):
    engine, hf, prompts, references = setup
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    alone = [next(iter(engine.generate([Request(0, p, params)]))).token_ids for p in prompts]
    assert_greedy_matches(hf, prompts, references, alone)
    results = {r.request_id: r for r in engine.generate(Request(i, p, params) for i, p in enumerate(prompts))}
    together = [results[i].token_ids for i in range(len(prompts))]
    assert_greedy_matches(hf, prompts, references, together)
    # The text is the decoded tokens, special tokens (EOS) dropped; some answers end at EOS, some hit the limit.
    for i, ids in enumerate(together):
        assert results[i].text == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert {r.finish_reason for r in results.values()} <= {"stop", "length"}
    assert any(r.finish_reason == "stop" for r in results.values())


def test_default_model_stop_strings(setup):
    engine, _, prompts, references = setup
    # Pick a word that the reference answer to the first prompt contains, and stop on it.
    text = engine.tokenizer.decode(references[0], skip_special_tokens=True)
    word = "Paris" if "Paris" in text else text.split()[2]
    result = next(iter(engine.generate([Request(0, prompts[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                                stop=[word]))])))
    assert result.finish_reason == "stop"
    assert result.text == text[: text.index(word)]
