"""The sampler: greedy, penalties, min_tokens, top-k/top-p/min-p, and seeded draws that depend only on
(seed, output position)."""
import math
import random

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from batchgen.engine.request import SamplingParams
from batchgen.engine.sampler import (PenaltyState, Sampler, SamplingBatch, apply_penalties, has_penalty,
                                     hash_uniforms)

V = 64
EOS = [2]


def build(params, seeds=None, prompts=None, outputs=None, vocab_size=V):
    n = len(params)
    seeds = seeds if seeds is not None else list(range(n))
    prompts = prompts if prompts is not None else [[5, 6, 7]] * n
    outputs = outputs if outputs is not None else [[]] * n
    states = [PenaltyState.from_tokens(prompt, output, vocab_size, "cpu") if has_penalty(p) else None
              for p, prompt, output in zip(params, prompts, outputs)]
    return SamplingBatch.build(params, seeds, [len(output) for output in outputs], states, EOS, vocab_size, "cpu")


def sample(logits, params, **kwargs):
    return Sampler()(logits, build(params, vocab_size=logits.shape[-1], **kwargs)).tolist()


def random_logits(rows, vocab_size=V, seed=0):
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


# --- greedy ----------------------------------------------------------------------------------------------------------

def test_greedy_is_argmax_and_builds_no_tensors():
    logits = random_logits(7)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2) for _ in range(7)]
    batch = build(params)
    assert batch.all_greedy and batch.temperature is None and batch.seeds is None and batch.banned_rows is None
    assert Sampler()(logits, batch).tolist() == logits.argmax(-1).tolist()


def test_tiny_temperature_is_greedy_and_greedy_rows_stay_greedy_in_a_random_batch():
    logits = random_logits(6)
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-7, 1.0, 0.0, 2.0, 1e-6)]
    tokens = sample(logits, params)
    for row in (0, 1, 3, 5):
        assert tokens[row] == logits[row].argmax().item()


# --- counter-based randomness ----------------------------------------------------------------------------------------

MASK64, MASK32 = (1 << 64) - 1, (1 << 32) - 1


def mix64_reference(x):
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix32_reference(x):
    x &= MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform_reference(seed, position, token):
    key = mix64_reference(mix64_reference(seed) ^ mix64_reference(position + 0x9E3779B97F4A7C15))
    x = mix32_reference(token ^ (key & MASK32))
    x = mix32_reference(x + (key >> 32))
    return ((x >> 9) * 2 + 1) / 2 ** 24


def test_hash_uniforms_match_unsigned_reference_arithmetic():
    """torch's int64/int32 ops wrap and shift arithmetically; the result must equal exact unsigned arithmetic."""
    seeds = [0, 1, 12345, 2 ** 62 + 7, 2 ** 63 - 1, -1, -(2 ** 63)]
    positions = [0, 1, 7, 1000, 3, 2 ** 40, 5]
    tokens = torch.tensor([[0, 1, 2, 49151, 2 ** 31 - 1]])
    u = hash_uniforms(torch.tensor(seeds), torch.tensor(positions), tokens.expand(len(seeds), -1))
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        for col, token in enumerate(tokens[0].tolist()):
            assert u[row, col].item() == uniform_reference(seed & MASK64, position, token)


def test_hash_uniforms_are_uniform_and_uncorrelated():
    n_rows, n_cols = 400, 2500
    seeds = torch.arange(n_rows) * 3 + 11  # small, adjacent seeds: the worst case for a weak mixer
    positions = torch.arange(n_rows) % 5
    u = hash_uniforms(seeds, positions, torch.arange(n_cols).expand(n_rows, -1)).double()
    assert 0 < u.min() and u.max() < 1
    flat = u.flatten()
    n = flat.numel()
    assert abs(flat.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(flat.var().item() - 1 / 12) < 0.002
    bins = 100
    counts = torch.bincount((flat * bins).long(), minlength=bins).double()
    chi_square = ((counts - n / bins) ** 2 / (n / bins)).sum().item()
    assert chi_square < bins + 5 * math.sqrt(2 * bins)  # mean 99, sd 14
    centred = u - 0.5
    limit = 5 / math.sqrt(n)  # correlation of independent uniforms ~ N(0, 1/n)
    for a, b in ((centred[:, 1:], centred[:, :-1]), (centred[1:], centred[:-1])):
        corr = (a * b).mean() / (1 / 12)
        assert abs(corr.item()) < limit * 1.1
    # Same seed, neighbouring positions: a different stream.
    same_seed = hash_uniforms(torch.tensor([5, 5]), torch.tensor([0, 1]), torch.arange(n_cols).expand(2, -1))
    assert abs(torch.corrcoef(same_seed.double())[0, 1].item()) < 5 / math.sqrt(n_cols)


def empirical(tokens, vocab_size):
    return torch.bincount(torch.tensor(tokens), minlength=vocab_size).double() / len(tokens)


def assert_close_to(freq, probs, n):
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-12).all(), (freq, probs)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_draws_follow_softmax_over_seeds_and_over_positions(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    probs = (logits.double() / temperature).softmax(-1)
    n = 20000
    params = [SamplingParams(temperature=temperature)] * n
    over_seeds = sample(logits.expand(n, -1), params, seeds=list(range(n)), outputs=[[]] * n)
    assert_close_to(empirical(over_seeds, 6), probs, n)
    lengths_only = [range(i) for i in range(n)]  # outputs of every length: the sampler reads only their lengths
    over_positions = sample(logits.expand(n, -1), params, seeds=[42] * n, outputs=lengths_only)
    assert_close_to(empirical(over_positions, 6), probs, n)


# --- batch independence ----------------------------------------------------------------------------------------------

def other_params(rng):
    return SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 1.3]), top_k=rng.choice([0, 0, 5, 40]),
                          top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.1]),
                          repetition_penalty=rng.choice([1.0, 1.2]), presence_penalty=rng.choice([0.0, 0.5]),
                          frequency_penalty=rng.choice([0.0, -0.3]), min_tokens=rng.choice([0, 3]))


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=1.1, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4),
])
def test_a_seeded_row_draws_the_same_token_alone_or_in_any_batch(target):
    rng = random.Random(0)
    logits = random_logits(1, 300, seed=1)[0]
    prompt, output = [3, 4, 9, 9, 17], [9, 100, 4]
    alone, in_batches = [], []
    for position in range(12):
        out = output + [position] * position  # the output grows as decoding goes on
        alone.append(sample(logits[None], [target], seeds=[1234], prompts=[prompt], outputs=[out])[0])
        others = [other_params(rng) for _ in range(50)]
        rows = others + [target]
        seeds = [rng.randrange(2 ** 63) for _ in others] + [1234]
        prompts = [[rng.randrange(300) for _ in range(5)] for _ in others] + [prompt]
        outputs = [[rng.randrange(300) for _ in range(rng.randrange(6))] for _ in others] + [out]
        batch_logits = [random_logits(1, 300, seed=rng.randrange(1000))[0] for _ in others] + [logits]
        order = list(range(len(rows)))
        rng.shuffle(order)
        tokens = sample(torch.stack([batch_logits[i] for i in order]), [rows[i] for i in order],
                        seeds=[seeds[i] for i in order], prompts=[prompts[i] for i in order],
                        outputs=[outputs[i] for i in order])
        in_batches.append(tokens[order.index(len(rows) - 1)])
    assert alone == in_batches
    assert len(set(alone)) > 1  # the draws are random, not a constant that would pass trivially


def test_the_same_seed_gives_the_same_tokens_and_another_seed_different_ones():
    logits = random_logits(1, 1000, seed=3).expand(30, -1) / 4
    params = [SamplingParams(temperature=1.0)] * 30
    outputs = [[0] * i for i in range(30)]
    first = sample(logits, params, seeds=[7] * 30, outputs=outputs)
    assert first == sample(logits, params, seeds=[7] * 30, outputs=outputs)
    assert first != sample(logits, params, seeds=[8] * 30, outputs=outputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_the_same_bits_as_cpu_and_stays_batch_independent():
    seeds = torch.tensor([0, 12345, -1, 2 ** 63 - 1])
    positions = torch.tensor([0, 5, 77, 2 ** 40])
    tokens = torch.arange(49152).expand(4, -1)
    assert torch.equal(hash_uniforms(seeds, positions, tokens),
                       hash_uniforms(seeds.cuda(), positions.cuda(), tokens.cuda()).cpu())
    logits = random_logits(64, 49152, seed=6).cuda()
    rng = random.Random(1)
    params = [other_params(rng) for _ in range(64)]
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=100)
    params[17] = target
    states = [PenaltyState.from_tokens([1, 2], [3], 49152, "cuda") if has_penalty(p) else None for p in params]
    full = Sampler()(logits, SamplingBatch.build(params, list(range(64)), [1] * 64, states, EOS, 49152, "cuda"))
    alone = Sampler()(logits[17:18], SamplingBatch.build([target], [17], [1], [None], EOS, 49152, "cuda"))
    assert full[17].item() == alone[0].item()


# --- top-k, top-p, min-p ---------------------------------------------------------------------------------------------

def allowed_tokens(logits, temperature, top_k, top_p, min_p):
    """The tokens each filter leaves, computed directly from the definitions (vLLM order)."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t].item() for t in kept)
    nucleus, before = [], 0.0
    for t in kept:
        if before >= top_p * mass:
            break
        nucleus.append(t)
        before += probs[t].item()
    best = probs[nucleus[0]].item()
    return {t for t in nucleus if probs[t].item() >= min_p * best}


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (0.8, 0, 1.0, 0.15), (1.3, 8, 0.7, 0.0), (1.0, 12, 0.9, 0.05),
    (2.0, 1, 1.0, 0.0),
])
@pytest.mark.parametrize("full_vocab_partner", [False, True], ids=["alone", "with_full_vocab_row"])
def test_filters_never_pick_a_masked_token_and_can_pick_every_kept_one(temperature, top_k, top_p, min_p,
                                                                       full_vocab_partner):
    logits = torch.linspace(3, -3, 20)[torch.randperm(20, generator=torch.Generator().manual_seed(5))]
    allowed = allowed_tokens(logits, temperature, top_k, top_p, min_p)
    assert 1 <= len(allowed) < 20
    n = 4000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * n
    # A row without top-k makes the batch sort the whole vocabulary instead of taking the top max_top_k.
    partner = [SamplingParams(temperature=1.0)] if full_vocab_partner else []
    tokens = sample(logits.expand(n + len(partner), -1), params + partner, seeds=list(range(n + len(partner))))
    tokens = tokens[:n]
    assert set(tokens) == allowed
    # Within the kept set the draw follows the renormalised distribution.
    probs = (logits.double() / temperature).softmax(-1)
    kept = torch.zeros(20, dtype=torch.bool)
    kept[list(allowed)] = True
    probs = torch.where(kept, probs, 0.0)
    assert_close_to(empirical(tokens, 20), probs / probs.sum(), n)


def test_top_k_path_sort_path_and_dense_path_agree_on_a_row():
    """A top-k row samples over its top max_top_k candidates unless another row in the batch needs the full
    vocabulary; the token must not depend on which."""
    logits = random_logits(1, 500, seed=9)[0]
    row = SamplingParams(temperature=1.2, top_k=30, top_p=0.95)
    partners = {"topk": SamplingParams(temperature=1.0, top_k=50), "sort": SamplingParams(temperature=1.0),
                "sort_top_p": SamplingParams(temperature=1.0, top_p=0.5)}
    tokens = {}
    for name, partner in partners.items():
        batch = build([partner, row], outputs=[[], []], vocab_size=500)
        assert (batch.max_top_k < 500) == (name == "topk")
        tokens[name] = [Sampler()(torch.stack([logits, logits]),
                                  build([partner, row], seeds=[1, s], vocab_size=500))[1].item() for s in range(200)]
    assert tokens["topk"] == tokens["sort"] == tokens["sort_top_p"]


# --- penalties -------------------------------------------------------------------------------------------------------

def test_repetition_penalty_equals_transformers_processor():
    logits = random_logits(3, V, seed=2)
    prompts = [[1, 5, 5, 9], [10, 11], [40, 41, 42]]
    outputs = [[9, 20, 63], [], [41, 41]]
    penalties = [1.3, 0.7, 2.0]
    batch = build([SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties],
                  prompts=prompts, outputs=outputs)
    ours = apply_penalties(logits.clone(), batch)
    for row, penalty in enumerate(penalties):
        ids = torch.tensor([prompts[row] + outputs[row]])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row], expected[0], rtol=0, atol=0)
    assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_follow_the_formula_over_output_tokens_only():
    logits = random_logits(2, V, seed=4)
    prompts = [[7, 8, 8], [1]]
    outputs = [[8, 8, 8, 30], [1, 1, 50]]
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=1.5)]
    ours = apply_penalties(logits.clone(), build(params, prompts=prompts, outputs=outputs))
    expected = logits.clone()
    for row, p in enumerate(params):
        for token in set(outputs[row]):
            expected[row, token] -= p.presence_penalty + p.frequency_penalty * outputs[row].count(token)
    torch.testing.assert_close(ours, expected)


def test_penalties_steer_the_greedy_token_and_ignore_ids_outside_the_vocabulary():
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 11] = 5.0, 4.0
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert sample(logits, [plain], outputs=[[10, V + 5]]) == [10]
    assert sample(logits, [penalised], outputs=[[10, V + 5]]) == [11]


# --- min_tokens ------------------------------------------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, EOS[0]], logits[0, 30], logits[0, 7] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[30])
    assert sample(logits, [params], outputs=[[]]) == [7]
    assert sample(logits, [params], outputs=[[7]]) == [7]
    assert sample(logits, [params], outputs=[[7, 7]]) == [EOS[0]]
    # ignore_eos: EOS stops nothing, so (as in vLLM) only the stop_token_ids are masked.
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[30], ignore_eos=True)
    assert sample(logits, [ignoring], outputs=[[]]) == [EOS[0]]
    logits[0, EOS[0]] = 0.0
    assert sample(logits, [ignoring], outputs=[[]]) == [7]
    # Random rows are masked too.
    logits = torch.full((200, V), -100.0)
    logits[:, EOS[0]] = 5.0
    logits[:, 8] = 4.0
    hot = [SamplingParams(temperature=3.0, min_tokens=1)] * 200
    assert set(sample(logits, hot, seeds=list(range(200)))) == {8}


# --- validation ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("temperature", float("nan")), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5),
    ("min_p", 2), ("min_p", -0.1), ("max_tokens", 0), ("max_tokens", "5"), ("seed", "x"), ("seed", 1.5),
    ("seed", True), ("repetition_penalty", 0), ("presence_penalty", 3),
    ("frequency_penalty", -2.5), ("min_tokens", -1), ("min_tokens", 17), ("stop", [1]), ("stop", [""]),
    ("stop", 5), ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("ignore_eos", "yes"),
    ("skip_special_tokens", 1),
])
def test_invalid_params_are_rejected_naming_the_field(field, value):
    params = SamplingParams()
    setattr(params, field, value)
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_valid_params_pass():
    SamplingParams(max_tokens=5, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, seed=-3, stop="x",
                   stop_token_ids=[0], min_tokens=5).validate()
    # Integral floats (a Parquet column with nulls is float), and any integer seed (the sampler takes it mod 2**64).
    SamplingParams(max_tokens=5.0, seed=10 ** 400, top_k=40.0).validate()
