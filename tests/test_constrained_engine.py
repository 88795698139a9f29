"""Constrained output, exact choice scoring, logprobs and n samples on the real default model, through the engine's
public request API; each compared with transformers where it has an answer, and across engine settings that
change how the work is cut (prefix caching off, a 16-token budget, a tiny KV pool with preemptions)."""
import json
import math
import re

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.request_group import sample_seed

LABELS = ["BILLING", "SHIPPING", "RETURNS", "ACCOUNT", "TECHNICAL", "PRODUCT", "PRIVACY", "FEEDBACK", "OTHER"]
TICKETS = [
    "I was charged twice for my order last week.",
    "My package has been stuck in transit for ten days.",
    "How do I send back the shoes? They are too small.",
    "I cannot log in, the password reset email never arrives.",
    "The app crashes every time I open the camera screen.",
    "Does this blender come with a glass jar or a plastic one?",
    "Please delete all the personal data you hold about me.",
    "Just wanted to say your support team was wonderful!",
    "What are your opening hours on public holidays?",
    "The invoice shows the wrong VAT number.",
    "The tracking link says delivered but nothing is at my door.",
    "I want a refund for the broken lamp.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "shipping", "returns", "other"]},
        "urgency": {"type": "integer", "minimum": 1, "maximum": 5},
        "customer": {"type": "object", "properties": {"angry": {"type": "boolean"}, "name": {"type": "string"}},
                     "required": ["angry"]},
        "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["category", "urgency", "customer", "keywords"],
}
DATE = r"\d{4}-\d{2}-\d{2}"


def chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def make_engine(model_dir, **overrides) -> Engine:
    args = dict(model=str(model_dir), dtype="float32", kv_cache_memory="256MiB", max_num_seqs=32)
    return Engine(EngineArgs(**{**args, **overrides}))


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return make_engine(default_model_dir)


@pytest.fixture(scope="module")
def prompts(engine):
    return {
        "label": [chat(engine.tokenizer, f"Which team handles this support ticket? Answer with one of "
                                         f"{', '.join(LABELS)}.\nTicket: {t}") for t in TICKETS],
        "json": [chat(engine.tokenizer, f"Describe this support ticket as JSON with a category, an urgency from 1 "
                                        f"to 5, the customer and keywords.\nTicket: {t}") for t in TICKETS[:6]],
        "date": [chat(engine.tokenizer, f"When did {event} happen? Answer with a date.")
                 for event in ("the moon landing", "the fall of the Berlin wall", "the first iPhone release")],
    }


def mixed_requests(prompts) -> list[Request]:
    """Every feature at once, with fixed ids: the same list must give the same results under any engine setting."""
    requests = [Request(("choice", i), p, SamplingParams(choice=LABELS, temperature=0.0, logprobs=3))
                for i, p in enumerate(prompts["label"])]
    requests += [Request(("choice-sampled", i), p, SamplingParams(choice=LABELS, temperature=1.0, seed=i, n=3))
                 for i, p in enumerate(prompts["label"][:4])]
    requests += [Request(("json", i), p, SamplingParams(json_schema=json.dumps(SCHEMA), temperature=0.0,
                                                        max_tokens=80)) for i, p in enumerate(prompts["json"])]
    requests += [Request(("json-sampled", i), p, SamplingParams(json_schema=json.dumps(SCHEMA), temperature=0.9,
                                                                seed=7 + i, max_tokens=80, n=2))
                 for i, p in enumerate(prompts["json"][:2])]
    requests += [Request(("date", i), p, SamplingParams(regex=DATE, temperature=0.0, max_tokens=16, logprobs=2))
                 for i, p in enumerate(prompts["date"])]
    requests += [Request(("free", i), p, SamplingParams(temperature=0.8, seed=3, n=4, max_tokens=12, logprobs=1))
                 for i, p in enumerate(prompts["date"])]
    return requests


def by_key(results) -> dict:
    out = {}
    for r in results:
        key = (r.request_id, r.sample_index)
        assert key not in out, f"{key} came out twice"
        out[key] = r
    return out


def assert_same(result, expected) -> None:
    """Equal tokens, texts and alternatives; probabilities equal up to float rounding (another batch shape sums
    in another order)."""
    assert (result.text, result.token_ids, result.finish_reason) == \
           (expected.text, expected.token_ids, expected.finish_reason)
    assert (result.top_logprobs is None) == (expected.top_logprobs is None)
    if result.top_logprobs is not None:
        assert [[(t, i) for t, i, _ in top] for top in result.top_logprobs] == \
               [[(t, i) for t, i, _ in top] for top in expected.top_logprobs]
    for mine, theirs in ((result.logprobs, expected.logprobs),
                         (result.choice_probs and [p for _, p in result.choice_probs],
                          expected.choice_probs and [p for _, p in expected.choice_probs])):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert mine == pytest.approx(theirs, abs=1e-4)


@pytest.fixture(scope="module")
def baseline(engine, prompts):
    return by_key(engine.generate(mixed_requests(prompts)))


def test_every_output_obeys_its_constraint(baseline):
    for (rid, sample), r in baseline.items():
        kind = rid[0]
        assert r.error is None and r.finish_reason in ("stop", "length"), (rid, r.error)
        if kind.startswith("choice"):
            assert r.text in LABELS and r.finish_reason == "stop"
            probs = [p for _, p in r.choice_probs]
            assert [c for c, _ in r.choice_probs] == LABELS
            assert abs(sum(probs) - 1.0) < 1e-6
            if kind == "choice":
                assert r.text == LABELS[probs.index(max(probs))]
        elif kind.startswith("json"):
            if r.finish_reason == "length":
                continue
            jsonschema.validate(json.loads(r.text), SCHEMA)
        elif kind == "date":
            assert r.finish_reason == "stop" and re.fullmatch(DATE, r.text), r.text
    samples = {rid: [] for rid, _ in baseline}
    for (rid, sample), r in baseline.items():
        samples[rid].append(sample)
    assert all(sorted(v) == list(range(len(v))) for v in samples.values())
    assert len(samples[("free", 0)]) == 4 and len(samples[("choice-sampled", 0)]) == 3
    # the JSON rows are not all cut short: the grammar lets the model close its object
    assert sum(r.finish_reason == "stop" for (rid, _), r in baseline.items() if rid[0] == "json") >= 4


@pytest.mark.parametrize("setting", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 16},
    {"kv_cache_memory": "12MiB", "max_num_seqs": 16},  # ~16 blocks of 16 fp32 tokens: preemptions
])
def test_same_outputs_however_the_work_is_cut(default_model_dir, prompts, baseline, setting):
    engine = make_engine(default_model_dir, **setting)
    results = by_key(engine.generate(mixed_requests(prompts)))
    assert results.keys() == baseline.keys()
    for key, r in results.items():
        assert_same(r, baseline[key])
    if "kv_cache_memory" in setting:
        assert engine.stats()["num_preemptions"] > 0


@pytest.fixture(scope="module")
def hf(default_model_dir):
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids`: [len(ids), V]."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_choice_scores_equal_transformers_teacher_forced_logprobs(engine, prompts, baseline, hf):
    eos = engine.output.eos_token_ids
    for i, prompt in enumerate(prompts["label"][:4]):
        r = baseline[(("choice", i), 0)]
        for label, total in zip(LABELS, r.choice_logprobs):
            tokens = engine.tokenizer.encode(label, add_special_tokens=False)
            logprobs = hf_logprobs(hf, prompt + tokens)
            positions = range(len(prompt) - 1, len(prompt) + len(tokens) - 1)
            expected = sum(logprobs[p, t].item() for p, t in zip(positions, tokens))
            expected += torch.logsumexp(logprobs[-1, sorted(eos)], dim=0).item()
            assert abs(total - expected) < 1e-4, (label, total, expected)
        # probabilities are the totals renormalised over the candidates
        norm = torch.logsumexp(torch.tensor(r.choice_logprobs, dtype=torch.float64), dim=0).item()
        for (_, prob), total in zip(r.choice_probs, r.choice_logprobs):
            assert abs(prob - math.exp(total - norm)) < 1e-9


def test_logprobs_are_the_models_distribution_before_masks(engine, prompts, baseline, hf):
    """vLLM's meaning: the logprob of each output token, and the top alternatives, under the model's own
    distribution, before penalties and before the grammar's mask (a date row's top alternatives include tokens
    that the regex forbids)."""
    for key in [(("date", 0), 0), (("date", 1), 0), (("free", 0), 2), (("choice", 0), 0)]:
        r = baseline[key]
        prompt = (prompts["date"] if key[0][0] in ("date", "free") else prompts["label"])[key[0][1]]
        logprobs = hf_logprobs(hf, prompt + r.token_ids)
        for step, token in enumerate(r.token_ids):
            row = logprobs[len(prompt) - 1 + step]
            assert abs(r.logprobs[step] - row[token].item()) < 1e-4
            top = row.topk(len(r.top_logprobs[step]))
            assert [t for _, t, _ in r.top_logprobs[step]] == top.indices.tolist()
            assert all(abs(lp - v) < 1e-4 for (_, _, lp), v in zip(r.top_logprobs[step], top.values.tolist()))
            assert all(text == engine.tokenizer.decode([t]) for text, t, _ in r.top_logprobs[step])
    first_date = baseline[(("date", 0), 0)]
    assert not first_date.top_logprobs[0][0][0].strip().isdigit()  # the model's favourite is not a digit


def test_sample_i_depends_only_on_seed_and_i(engine, prompts, baseline):
    prompt = prompts["date"][0]
    alone = {i: next(iter(engine.generate([Request("one", prompt, SamplingParams(
        temperature=0.8, seed=sample_seed(3, i), max_tokens=12))]))) for i in range(4)}
    for i in range(4):
        assert baseline[(("free", 0), i)].token_ids == alone[i].token_ids
    two = by_key(engine.generate([Request("two", prompt, SamplingParams(temperature=0.8, seed=3, n=2,
                                                                         max_tokens=12))]))
    assert [two[("two", i)].token_ids for i in range(2)] == [alone[i].token_ids for i in range(2)]
    assert len({tuple(r.token_ids) for r in alone.values()}) > 1  # the samples differ


def test_n_samples_prefill_the_prompt_once(default_model_dir, prompts):
    engine = make_engine(default_model_dir, enable_prefix_caching=False)
    prompt = prompts["json"][0]
    computed = []

    def run(n):
        before = engine.num_steps
        tokens = 0
        engine.add_request(Request(("n", n), prompt, SamplingParams(temperature=1.0, seed=0, n=n, max_tokens=1)))
        results = []
        while engine.has_unfinished():
            results += engine.step()
            tokens += engine.last_step.num_prefill_tokens + engine.last_step.num_decodes
        computed.append(tokens)
        return results, engine.num_steps - before

    run(1)
    results, _ = run(8)
    assert len(results) == 8
    # the prompt once, then its last token once per sample
    assert computed[1] == len(prompt) - 1 + 8 == computed[0] + 7


def test_choice_costs_one_prefill_plus_the_candidates(default_model_dir, prompts):
    engine = make_engine(default_model_dir, enable_prefix_caching=False)
    prompt = prompts["label"][0]
    engine.add_request(Request("c", prompt, SamplingParams(choice=LABELS)))
    tokens = 0
    while engine.has_unfinished():
        engine.step()
        tokens += engine.last_step.num_prefill_tokens + engine.last_step.num_decodes
    candidate_tokens = sum(len(engine.tokenizer.encode(label, add_special_tokens=False)) for label in LABELS)
    assert tokens == len(prompt) - 1 + len(LABELS) + candidate_tokens


def test_bad_per_request_constraint_is_that_requests_error(engine, prompts):
    params = SamplingParams(temperature=0.0)
    params.regex = "(unclosed"
    results = by_key(engine.generate([Request("bad", prompts["date"][0], params),
                                      Request("good", prompts["date"][0], SamplingParams(regex=DATE, max_tokens=16))]))
    assert results[("bad", 0)].finish_reason == "error" and "regex" in results[("bad", 0)].error
    assert re.fullmatch(DATE, results[("good", 0)].text)


def test_abort_drops_every_sample_and_candidate(engine, prompts):
    engine.add_request(Request("a", prompts["label"][0], SamplingParams(choice=LABELS)))
    engine.add_request(Request("b", prompts["date"][0], SamplingParams(n=3, max_tokens=30, temperature=1.0)))
    engine.step()  # computes the shared prompts: the candidates and samples are forked, not finished
    assert engine.abort("a") and engine.abort("b")
    assert not engine.has_unfinished()
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.kv_cache_manager.pool.num_blocks


def test_eos_is_allowed_exactly_when_the_grammar_accepts(engine):
    """The bitmask of a regex `[0-9]{2}(ab)?`: EOS is masked until two digits are in, then allowed (the grammar
    accepts) next to `ab`; after `ab`, EOS is the only token left."""
    from batchgen.engine.structured import TokenBitmask

    tokenizer, eos = engine.tokenizer, engine.eos_token_ids
    matcher = engine.grammars.matcher("regex", "[0-9]{2}(ab)?")
    bitmask = TokenBitmask(engine.vocab_size)

    def allowed() -> torch.Tensor:
        logits = torch.zeros(1, engine.vocab_size)
        bitmask.apply(logits, {0: matcher})
        return torch.isfinite(logits[0])

    digit = tokenizer.convert_tokens_to_ids("4")
    assert not allowed()[eos].any() and allowed()[digit]
    assert matcher.accept(digit) and not allowed()[eos].any()
    assert matcher.accept(digit)
    now = allowed()
    assert now[eos].all() and now[tokenizer.convert_tokens_to_ids("a")] and not now[digit]
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert matcher.accept(token)
    now = allowed()
    assert now[eos].all() and int(now.sum()) == len(eos)
    assert matcher.accept(eos[0]) and matcher.is_terminated


def test_special_tokens_never_enter_constrained_text(engine):
    """Inside a JSON string any text may follow, but not a control token such as <|im_start|>: the grammar's
    vocabulary leaves the special tokens (EOS aside) out."""
    from batchgen.engine.structured import TokenBitmask

    tokenizer = engine.tokenizer
    matcher = engine.grammars.matcher("json_schema", json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}}, "required": ["name"]}))
    for token in tokenizer.encode('{"name": "Bo', add_special_tokens=False):
        assert matcher.accept(token)
    logits = torch.zeros(1, engine.vocab_size)
    TokenBitmask(engine.vocab_size).apply(logits, {0: matcher})
    special = [t for t, added in tokenizer.added_tokens_decoder.items() if added.special]
    assert len(special) > 10 and not torch.isfinite(logits[0, special]).any()
    assert torch.isfinite(logits[0, tokenizer.encode("b", add_special_tokens=False)]).all()


@pytest.mark.parametrize("vocab", [49152, 1000 + 7])
def test_cpu_bitmask_kernel_equals_xgrammars_apply(vocab):
    """batchgen's C++ apply (the CPU path) sets exactly the logits xgrammar's own apply sets, on the rows asked
    for only: all-forbidden, all-allowed and mixed words, and a vocabulary that ends inside a word."""
    import xgrammar as xgr
    from batchgen_kernels import cpu_build

    if not cpu_build.load():
        pytest.skip("the C++ CPU kernels do not build here")
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, -(-vocab // 32)), dtype=torch.int32, generator=generator)
    bitmask[1] = 0
    bitmask[2] = -1
    bitmask[3, ::2] = 0
    logits = torch.randn(6, vocab, generator=generator)
    rows = [0, 1, 2, 3, 5]
    ours, theirs = logits.clone(), logits.clone()
    torch.ops.batchgen.apply_token_bitmask_(ours, bitmask, torch.tensor(rows))
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[4], logits[4]) and torch.isinf(ours[1]).all() and torch.equal(ours[2], logits[2])
