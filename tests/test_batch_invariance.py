"""engine.batch_invariant (README, "Determinism"): a row's output tokens and their logprobs are bit-identical
whatever else runs with it. 64 varied prompts (5-300 tokens, a third of them behind shared prefixes), half greedy
and half seeded sampling, with logprobs, on a small random Llama whose attention has head_dim 64 as real models do:
in one batch (the reference), each alone, in batches of 3 in reversed order, with prefills cut into chunks, with a
KV pool small enough to preempt (and recompute), with prefix caching off, and on 1 thread against 2 — in fp32,
bf16, int8 (W8A8) and int8 weight-only; and on a Gemma 3 shaped model whose sliding-window layers the rows outgrow. Comparing logprobs as floats, not only tokens, is what makes this strict:
a difference in the last bit of a logit shows even where the argmax does not move.

Ray replicas and a kill -9 + resume: test_ray_executor.py, with batch_invariant on the default model."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.errors import SettingError

from conftest import save_tiny_model

NUM_PROMPTS, MAX_TOKENS, VOCAB = 64, 10, 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return save_tiny_model(config, tmp_path_factory.mktemp("invariant_llama"), seed=3)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    """Gemma 3 shaped: three sliding-window layers of 80 tokens (more than one 64-key tile, less than most prompts)
    and a global one."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                              sliding_window=80, query_pre_attn_scalar=64,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"],
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                              architectures=["Gemma3ForCausalLM"], tie_word_embeddings=True)
    return save_tiny_model(config, tmp_path_factory.mktemp("invariant_gemma3"), seed=4)


def prompts() -> list[list[int]]:
    """Lengths 5-300; prompts 0-20 share a 48-token prefix and 21-31 a 100-token one (prefix-cache hits)."""
    generator = torch.Generator().manual_seed(0)
    shared = {0: torch.randint(1, VOCAB, (48,), generator=generator).tolist(),
              1: torch.randint(1, VOCAB, (100,), generator=generator).tolist()}
    out = []
    for i in range(NUM_PROMPTS):
        length = int(torch.randint(5, 300, (1,), generator=generator))
        own = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        out.append(shared[0] + own if i <= 20 else shared[1] + own if i <= 31 else own)
    return out


def requests() -> list[Request]:
    """Even rows greedy, odd rows sampled at temperature 0.9 with their own seed; 2 top logprobs each token."""
    return [Request(i, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 == 0 else 0.9,
                                           seed=None if i % 2 == 0 else 1000 + i, ignore_eos=True, logprobs=2))
            for i, ids in enumerate(prompts())]


def run(model_dir: Path, dtype: str, quantization: str | None, order: str = "forward", threads: int | None = None,
        **engine) -> tuple[dict, dict]:
    """Every request's (token ids, logprobs, top logprobs), and the engine's stats."""
    args = EngineArgs(model=str(model_dir), device="cpu", dtype=dtype, quantization=quantization,
                      batch_invariant=True, **{"kv_cache_memory": "64MiB", **engine})
    reqs = requests()[::-1] if order == "reversed" else requests()
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        eng = Engine(args)
        results = {r.request_id: (r.token_ids, r.logprobs, r.top_logprobs) for r in eng.generate(reqs)}
        return results, eng.stats()
    finally:
        torch.set_num_threads(before)


# The ways a row's company changes; each against the reference: one batch of all 64, prefix caching on, the
# process's threads (an xdist worker's one; 2 on this project's machines without xdist) and "other threads" the
# other count of the two.
VARIANTS = {
    "alone": dict(max_num_seqs=1),
    "batches of 3, reversed": dict(max_num_seqs=3, order="reversed"),
    "chunked prefills": dict(max_num_batched_tokens=40),
    "preempted": dict(max_num_seqs=16),  # with a KV pool small enough to preempt (check_invariance's argument)
    "prefix caching off": dict(enable_prefix_caching=False),
    "other threads": dict(threads=None),
}
DTYPES = [("float32", None), ("bfloat16", None), ("float32", "int8"), ("bfloat16", "int8-weight-only")]


def check_invariance(model_dir: Path, dtype: str, quantization: str | None, preempting_pool: str) -> None:
    reference, stats = run(model_dir, dtype, quantization, max_num_seqs=NUM_PROMPTS)
    assert len(reference) == NUM_PROMPTS and stats["prefix_cache_hit_rate"] > 0
    for name, variant in VARIANTS.items():
        if name == "preempted":
            variant = {**variant, "kv_cache_memory": preempting_pool}
        if name == "other threads":
            variant = {**variant, "threads": 1 if torch.get_num_threads() > 1 else 2}
        results, stats = run(model_dir, dtype, quantization, **variant)
        if name == "preempted":
            assert stats["num_preemptions"] > 0, "the pool did not preempt"
        if name == "chunked prefills":
            assert stats["num_steps"] > NUM_PROMPTS  # 40-token steps: every long prompt in several chunks
        differing = [i for i in range(NUM_PROMPTS) if results[i] != reference[i]]
        assert not differing, f"{name}: rows {differing} differ from the one-batch run"


@pytest.mark.parametrize("dtype,quantization", DTYPES, ids=[f"{d}-{q or 'plain'}" for d, q in DTYPES])
def test_a_row_is_bit_identical_whatever_runs_beside_it(model_dir, dtype, quantization):
    check_invariance(model_dir, dtype, quantization, "1536KiB")  # 768 fp32 tokens: the longest row needs 409


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sliding_window_layers_too(gemma_dir, dtype):
    """Rows of 15-410 tokens through 80-token windows: a window's first key tile is laid from the row's own
    position, not from its chunk's or its batch's, and blocks that left the window are never read."""
    check_invariance(gemma_dir, dtype, None, "3MiB")  # at 1536KiB the longest rows would not fit at all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1536, 576), (2048, 512), (8192, 2048)])
def test_a_packed_linear_gives_a_lone_row_the_bits_it_gets_in_company(dtype, shape):
    """On AVX-512 CPUs oneDNN runs a single row through another kernel (1536->576 is the default model's MLP down
    projection, whose fp32 lone rows differed there); the tiny models above are too narrow to meet it."""
    from batchgen.models.packed_linear import PackedLinear, packing_supported

    if not packing_supported(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN takes no {dtype} on this CPU")
    k, n = shape
    generator = torch.Generator().manual_seed(0)
    linear = PackedLinear(torch.randn(n, k, generator=generator).to(dtype) / k**0.5, None)
    linear.batch_invariant = True
    x = torch.randn(40, k, generator=generator).to(dtype)
    full = linear(x)
    for rows in (1, 2, 3, 17):
        assert torch.equal(linear(x[:rows]), full[:rows]), f"{rows} row(s)"
    assert torch.equal(linear(x[0]), full[0])  # a row without its batch dimension


def test_it_is_refused_where_it_cannot_be_kept(model_dir):
    args = EngineArgs(model=str(model_dir), device="cpu", dtype="float32", batch_invariant=True,
                      kv_cache_memory="64MiB")
    with pytest.raises(SettingError, match="attention_backend torch cannot be honoured") as err:
        Engine(dataclasses.replace(args, attention_backend="torch"))
    assert err.value.key == "batch_invariant"
    with pytest.raises(SettingError, match="must be true or false"):
        dataclasses.replace(args, batch_invariant="yes").validate()
