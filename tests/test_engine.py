"""The engine against transformers on tiny random models: greedy equality under every scheduling path."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen.bench.greedy_check import assert_greedy_matches, hf_greedy
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams

MAX_TOKENS = 24


def make_engine(model_dir, **kwargs):
    args = dict(model=str(model_dir), dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=512, max_num_seqs=64)
    args.update(kwargs)
    return Engine(EngineArgs(**args))


def random_prompts(seed, n, vocab, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 70))] for _ in range(n)]


def greedy(n=MAX_TOKENS):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine, prompts, params=None):
    results = {r.request_id: r for r in engine.generate(Request(i, p, params or greedy()) for i, p in enumerate(prompts))}
    assert sorted(results) == list(range(len(prompts)))
    return [results[i] for i in range(len(prompts))]


def assert_no_leak(engine):
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen3_dir"])
def model_case(request):
    model_dir = request.getfixturevalue(request.param)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # random weights: generate exactly MAX_TOKENS, like ignore_eos
    prompts = random_prompts(0, 12, hf.config.vocab_size) + random_prompts(1, 6, hf.config.vocab_size, shared_prefix=40)
    references = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return model_dir, hf, prompts, references


def test_greedy_matches_transformers_alone_and_batched(model_case):
    model_dir, hf, prompts, references = model_case
    engine = make_engine(model_dir)
    alone = [run(engine, [p])[0].token_ids for p in prompts]
    assert_greedy_matches(hf, prompts, references, alone)
    together = [r.token_ids for r in run(engine, prompts)]
    assert_greedy_matches(hf, prompts, references, together)
    assert_no_leak(engine)


@pytest.mark.parametrize("variant", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),  # forces chunked prefill, decodes and prefill chunks in one step
    dict(kv_cache_memory="160KiB", block_size=16, max_num_batched_tokens=256),  # a pool too small: preemption
    dict(enforce_eager=True),  # the plain torch elementwise ops instead of the fused CPU kernels
])
def test_scheduling_variants_give_same_outputs(model_case, variant):
    model_dir, hf, prompts, references = model_case
    engine = make_engine(model_dir, **variant)
    results = run(engine, prompts)
    assert all(r.finish_reason == "length" and r.output_tokens == MAX_TOKENS for r in results)
    assert_greedy_matches(hf, prompts, references, [r.token_ids for r in results])
    if "kv_cache_memory" in variant:
        assert engine.stats()["num_preemptions"] > 0
        assert sum(r.num_preemptions for r in results) == engine.stats()["num_preemptions"]
    assert_no_leak(engine)


def test_cached_tokens_for_shared_prefix(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, block_size=16)
    rng = random.Random(3)
    prefix = [rng.randrange(200) for _ in range(50)]  # 3 full blocks of 16 shared, then the prompts differ
    prompts = [prefix + [rng.randrange(200) for _ in range(10)] for _ in range(5)]
    results = run(engine, prompts, greedy(4))
    assert [r.cached_tokens for r in results] == [0, 48, 48, 48, 48]
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 4 * 48 and stats["prefix_cache_queries"] == 5 * 60
    # Freed blocks stay cached: the same prompt again hits everything but its last (partial) block.
    again = run(engine, prompts[:1], greedy(4))[0]
    assert again.cached_tokens == 48
    uncached = make_engine(tiny_llama_dir, block_size=16, enable_prefix_caching=False)
    assert [r.cached_tokens for r in run(uncached, prompts, greedy(4))] == [0] * 5
    assert_no_leak(engine)


def test_seeded_request_independent_of_batch(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    target = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    prompt = random_prompts(7, 1, 256)[0]
    alone = next(iter(engine.generate([Request("target", prompt, target)]))).token_ids
    rng = random.Random(5)
    others = [Request(i, p, SamplingParams(max_tokens=rng.randint(1, 20), temperature=rng.choice([0.0, 0.7, 1.3]),
                                           top_k=rng.choice([0, 5]), seed=rng.choice([None, i]), ignore_eos=True))
              for i, p in enumerate(random_prompts(8, 50, 256))]
    batch = others + [Request("target", prompt, target)]
    rng.shuffle(batch)
    results = {r.request_id: r for r in engine.generate(batch)}
    assert results["target"].token_ids == alone
    unseeded = SamplingParams(max_tokens=16, temperature=0.9, ignore_eos=True)
    draws = {tuple(next(iter(engine.generate([Request(k, prompt, unseeded)]))).token_ids) for k in range(3)}
    assert len(draws) > 1  # unseeded requests do draw fresh randomness


def test_bad_requests_get_error_results_and_others_complete(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ok = random_prompts(9, 3, 256)
    requests = [
        Request("long", [1] * (engine.max_model_len + 5), greedy()),
        Request("empty", [], greedy()),
        Request("bad-temp", ok[0], SamplingParams(temperature=-1.0)),
        Request("bad-top-p", ok[0], SamplingParams(top_p=0.0)),
        Request("bad-max", ok[0], SamplingParams(max_tokens=0)),
        Request("bad-token", [10**9], greedy()),
    ] + [Request(i, p, greedy(8)) for i, p in enumerate(ok)]
    results = {r.request_id: r for r in engine.generate(requests)}
    assert len(results) == len(requests)
    for rid, word in [("long", "context"), ("empty", "empty"), ("bad-temp", "temperature"), ("bad-top-p", "top_p"),
                      ("bad-max", "max_tokens"), ("bad-token", "token")]:
        assert results[rid].finish_reason == "error" and word in results[rid].error, (rid, results[rid].error)
        assert results[rid].token_ids == []
    for i in range(3):
        assert results[i].finish_reason == "length" and results[i].output_tokens == 8 and results[i].error is None
    assert_no_leak(engine)


def test_kv_pool_smaller_than_context_gives_error_not_stall(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, kv_cache_memory="40KiB", block_size=16)  # a few blocks only
    capacity = engine.kv_capacity
    assert capacity < 512
    results = {r.request_id: r for r in engine.generate(
        [Request("huge", [3] * (capacity + 10), greedy()), Request("fits", [3] * 10, greedy(4))])}
    assert results["huge"].finish_reason == "error" and "KV cache" in results["huge"].error
    assert results["fits"].finish_reason == "length"
    # A request that fits alone but grows past the pool stops at its capacity instead of stalling.
    long_gen = next(iter(engine.generate([Request("grow", [3] * 10, greedy(10_000))])))
    assert long_gen.finish_reason == "length" and long_gen.prompt_tokens + long_gen.output_tokens == capacity


def test_timestamps_are_ordered(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    for r in run(engine, random_prompts(11, 10, 256)):
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time
        assert 0 <= r.queue_s <= r.ttft_s <= r.e2e_s
        assert r.tpot_s is not None and r.tpot_s >= 0


def test_model_forward_has_no_per_sequence_python_loop(tiny_llama_dir):
    """Python-level calls made by the model (the attention backend aside) must not grow with the number of sequences:
    every forward, of 2 sequences or 16, prefill or decode, makes the same number."""
    import sys

    engine = make_engine(tiny_llama_dir)
    model = engine.model
    per_forward = []
    original = model.forward

    def profiled(*args, **kwargs):
        state = {"calls": 0, "in_kernel": 0}

        def tracer(frame, event, arg):
            in_kernel = "batchgen_kernels" in frame.f_code.co_filename
            if event == "call":
                state["in_kernel"] += in_kernel
                state["calls"] += not state["in_kernel"]
            elif event == "return":
                state["in_kernel"] -= in_kernel
        sys.setprofile(tracer)
        try:
            return original(*args, **kwargs)
        finally:
            sys.setprofile(None)
            per_forward.append(state["calls"])

    model.forward = profiled
    try:
        for n in (2, 16):
            run(engine, random_prompts(13, n, 256), greedy(3))
    finally:
        del model.forward
    assert len(per_forward) >= 6 and len(set(per_forward)) == 1, per_forward


# --- the public request API: add_request, step, abort, has_unfinished ----------------------------------------------

def test_add_request_and_step_give_what_generate_gives(tiny_llama_dir):
    prompts = random_prompts(21, 6, 256)
    expected = [r.token_ids for r in run(make_engine(tiny_llama_dir), prompts)]
    engine = make_engine(tiny_llama_dir)
    assert engine.step() == [] and not engine.has_unfinished()  # idle: a step does nothing
    for i, p in enumerate(prompts):
        engine.add_request(Request(i, p, greedy()))
    engine.add_request(Request("bad", [], greedy()))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request(Request(0, prompts[0], greedy()))
    first = engine.step()
    assert [r.request_id for r in first] == ["bad"] and first[0].finish_reason == "error"  # rejected: at once
    assert engine.last_step.num_seqs == 6 and engine.last_step.num_prefill_tokens == sum(map(len, prompts))
    results = {}
    while engine.has_unfinished():
        results.update((r.request_id, r) for r in engine.step())
    assert engine.last_step.num_decodes == engine.last_step.num_seqs and engine.last_step.num_prefill_tokens == 0
    assert [results[i].token_ids for i in range(6)] == expected
    assert_no_leak(engine)


def test_abort_gives_back_blocks_and_yields_nothing(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=2)
    prompts = random_prompts(22, 4, 256)
    for i, p in enumerate(prompts):
        engine.add_request(Request(i, p, greedy(50)))
    for _ in range(3):
        assert engine.step() == []
    assert engine.abort(0) and engine.abort(3)  # one running, one still waiting
    assert not engine.abort(0) and not engine.abort("unknown")
    results = []
    while engine.has_unfinished():
        results += engine.step()
    assert sorted(r.request_id for r in results) == [1, 2]
    assert [r.output_tokens for r in results] == [50, 50]
    assert_no_leak(engine)
    engine.add_request(Request(0, prompts[0], greedy(4)))  # an aborted id may be used again
    assert [r.output_tokens for r in engine.step() + engine.step() + engine.step() + engine.step()] == [4]


def test_penalties_match_transformers_and_survive_preemption(tiny_llama_dir):
    """The sampler's penalty state is kept up to date token by token: greedy output with a repetition penalty equals
    transformers' own, and a forced preemption (the pool is tiny) changes nothing."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = [p[:12] for p in random_prompts(23, 4, 64)]  # a small vocabulary: repeats are likely
    params = SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.8, ignore_eos=True)
    references = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, repetition_penalty=1.8,
                          eos_token_id=None, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        references.append(out[0, len(p):].tolist())
    roomy = run(make_engine(tiny_llama_dir), prompts, params)
    assert [r.token_ids for r in roomy] == references
    tight = make_engine(tiny_llama_dir, kv_cache_memory="48KiB", block_size=16, max_num_batched_tokens=64)
    tight_results = run(tight, prompts, params)
    assert sum(r.num_preemptions for r in tight_results) > 0
    assert [r.token_ids for r in tight_results] == references
    mixed = SamplingParams(max_tokens=20, temperature=0.8, presence_penalty=1.0, frequency_penalty=0.5, seed=3,
                           ignore_eos=True)
    assert [r.token_ids for r in run(make_engine(tiny_llama_dir), prompts, mixed)] == \
        [r.token_ids for r in run(tight, prompts, mixed)]


def test_max_tokens_none_generates_until_the_context_ends(tiny_llama_dir):
    """max_tokens None (OpenAI's and vLLM's requests without it): every sequence runs to max_model_len, whatever its
    prompt's length, and frees its blocks."""
    engine = make_engine(tiny_llama_dir, max_model_len=48)
    prompts = [[5] * 3, [7] * 20, [9] * 47]
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True, min_tokens=1)
    params.validate()
    results = run(engine, prompts, params)
    assert [len(r.token_ids) for r in results] == [45, 28, 1]
    assert all(r.finish_reason == "length" for r in results)
    assert_no_leak(engine)
