"""Sliding-window layers keep no more KV than their window needs (engine/sliding_window.py).

A tiny random Gemma 3 (window 8, three local layers and a global one) in 4-token blocks, so that a window spans
two or three blocks, with prompts and outputs far past the window: greedy output equals transformers' with the
prefix cache on and off, chunked prefill, a pool small enough to preempt, the C++ and Triton kernels, forked
samples and the padded decode path; at every step the local blocks in use stay within the window's bound while the
global ones grow; a prefix-cache hit still serves a prefix whose first local blocks left a pool too small to hold
them; no kernel reads the null block that stands for the blocks that left; and the engine, its stats, `batchgen plan`
and the sizing rule agree on both pools. Llama (one group) keeps its single pool: tests/test_kv_memory.py."""
from __future__ import annotations

import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from attention_cases import assert_close, make_case
from batchgen.bench.greedy_check import assert_greedy_matches, hf_greedy
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.kv_pool import size_kv_pool
from batchgen.engine.sliding_window import LocalLayers, hit_blocks, kv_layout, local_blocks_at_most
from batchgen_kernels import AttentionMetadata, cpu_backend, reference

WINDOW, BLOCK = 8, 4
WINDOW_BLOCKS = hit_blocks(WINDOW, BLOCK)  # 2: the blocks of the 7 keys before a block boundary
MAX_TOKENS = 20


def engine_for(model_dir, **kwargs) -> Engine:
    args = dict(model=str(model_dir), dtype="float32", kv_cache_memory="32MiB", max_num_seqs=32, block_size=BLOCK)
    return Engine(EngineArgs(**{**args, **kwargs}))


def greedy(n: int = MAX_TOKENS, samples: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, n=samples)


def local_bound(num_seqs: int, num_prefills: int, prefill_tokens: int) -> int:
    """The most local blocks a step's sequences hold: a sequence computing n tokens from position c holds the
    blocks of positions c - WINDOW + 1 .. c + n - 1, at most ceil((WINDOW + n - 2) / BLOCK) + 1 blocks, which is
    WINDOW_BLOCKS + 1 for a decode; summed over a step, at most this."""
    return num_seqs * (WINDOW_BLOCKS + 1) + num_prefills + -(-prefill_tokens // BLOCK)


def run_checked(engine: Engine, requests: list[Request]) -> dict:
    """Step the engine through `requests`; after every step the local blocks in use are within local_bound of
    the step (read from Engine.stats). Returns {request_id: [token ids of each sample]}."""
    for request in requests:
        engine.add_request(request)
    outputs, most_global = {}, 0
    while engine.has_unfinished():
        for result in engine.step():
            outputs.setdefault(result.request_id, []).append(result.token_ids)
        stats, step = engine.stats(), engine.last_step
        most_global = max(most_global, stats["kv_blocks_in_use"])
        # a speculating decode computes its guesses too: counted as a prefill of them
        guessing = step.num_seqs if step.num_draft_tokens else 0
        bound = local_bound(step.num_seqs, step.num_seqs - step.num_decodes + guessing,
                            step.num_prefill_tokens + step.num_draft_tokens)
        assert stats["kv_local_blocks_in_use"] <= bound, (step, stats["kv_local_blocks_in_use"])
    stats = engine.stats()
    assert stats["kv_blocks_in_use"] == stats["kv_local_blocks_in_use"] == 0  # all given back, in both pools
    assert most_global > 3 * (WINDOW_BLOCKS + 1)  # the global blocks were not bounded by the window
    return outputs


@pytest.fixture(scope="module")
def hf(tiny_gemma3_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    return model


@pytest.fixture(scope="module")
def cases(hf):
    """Prompts of 3 to 63 tokens (8 of them share a 30-token prefix), each with 20 greedy tokens: up to 10
    windows."""
    rng = random.Random(5)
    shared = [rng.randrange(384) for _ in range(30)]
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (3, 9, 21, 50)]
    prompts += [shared + [rng.randrange(384) for _ in range(n)] for n in (1, 6, 13, 33)]
    return prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def fewer(cases, tokens: int = 12):
    """Four of the cases (9 to 63 prompt tokens), `tokens` greedy tokens each: for the Triton interpreter's
    sake (slow), still far past the window."""
    prompts, references = cases
    chosen = [1, 3, 6, 7]
    return [prompts[i] for i in chosen], [references[i][:tokens] for i in chosen], tokens


SETTINGS = {
    "batched": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 8},
    # 40 global blocks (160 tokens) and 41 local ones: the sequences outgrow them together and preempt
    "preempting": {"kv_cache_memory": 40 * BLOCK * 256 + 41 * BLOCK * 768},
    "cpu-kernels": {"attention_backend": "cpu", "max_num_batched_tokens": 16},
    "triton": {"attention_backend": "triton", "max_num_batched_tokens": 64},  # fewer() cases, no second run
    # guesses' slots across block edges in both pools, fallen ones written over (a random model repeats itself)
    "speculating": {"speculative": {"method": "ngram", "num_tokens": 5, "min_match": 1, "max_batch": 32}},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_matches_transformers_far_past_the_window(tiny_gemma3_dir, hf, cases, name):
    if name == "triton":
        pytest.importorskip("triton")
    prompts, references, tokens = fewer(cases) if name == "triton" else (*cases, MAX_TOKENS)
    engine = engine_for(tiny_gemma3_dir, **SETTINGS[name])
    assert engine.stats()["kv_local_window"] == WINDOW
    outputs = run_checked(engine, [Request(i, p, greedy(tokens)) for i, p in enumerate(prompts)])
    assert_greedy_matches(hf, prompts, references, [outputs[i][0] for i in range(len(prompts))])
    stats = engine.stats()
    if name == "speculating":
        assert stats["spec_accepted_tokens"] > 0, stats
    if name == "preempting":
        assert stats["kv_pool_blocks"] == 40 and stats["kv_local_pool_blocks"] == 41
        assert stats["num_preemptions"] > 0
    if name not in ("no-prefix-cache", "preempting", "triton"):
        # Again: each prompt is cached now (the pools hold them all), its hit block-aligned
        hits = stats["prefix_cache_hits"]
        again = run_checked(engine, [Request(i, p, greedy()) for i, p in enumerate(prompts)])
        assert_greedy_matches(hf, prompts, references, [again[i][0] for i in range(len(prompts))])
        assert engine.stats()["prefix_cache_hits"] - hits == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)


def test_a_lone_sequence_holds_its_window_and_no_more(tiny_gemma3_dir):
    """One sequence, 3-token chunks: the local blocks it holds after each step are those of the window's keys and
    the chunk's (a decode's: WINDOW_BLOCKS + 1), while its global blocks grow with it."""
    engine = engine_for(tiny_gemma3_dir, max_num_seqs=1, max_num_batched_tokens=3)
    engine.add_request(Request(0, list(range(40)), greedy(30)))
    seen_local, seen_global = [], []
    while engine.has_unfinished():
        engine.step()
        step, stats = engine.last_step, engine.stats()
        scheduled = step.num_decodes + step.num_prefill_tokens
        seen_local.append(stats["kv_local_blocks_in_use"])
        seen_global.append(stats["kv_blocks_in_use"])
        assert stats["kv_local_blocks_in_use"] <= -(-(WINDOW + scheduled - 2) // BLOCK) + 1
    assert max(seen_local[-20:]) == WINDOW_BLOCKS + 1  # decoding: exactly the window's bound, reached
    stats = engine.stats()
    assert stats["kv_peak_blocks_used"] == -(-69 // BLOCK)  # 40 + 30 tokens, the last one never computed
    assert stats["kv_local_peak_blocks_used"] <= -(-(WINDOW + 3 - 2) // BLOCK) + 1


def test_forked_samples_share_and_copy_local_blocks(tiny_gemma3_dir, hf, cases):
    """n greedy samples fork from one computed prompt (its partly filled last block copied on write, in both
    pools): each equals transformers' greedy output."""
    prompts, references = cases
    engine = engine_for(tiny_gemma3_dir)
    outputs = run_checked(engine, [Request(i, p, greedy(samples=3)) for i, p in enumerate(prompts)])
    for samples in range(3):
        assert_greedy_matches(hf, prompts, references, [outputs[i][samples] for i in range(len(prompts))])


def test_abort_gives_back_both_pools(tiny_gemma3_dir):
    engine = engine_for(tiny_gemma3_dir)
    for i in range(3):
        engine.add_request(Request(i, list(range(10 + i, 50 + i)), greedy(30)))
    for _ in range(12):
        engine.step()
    assert engine.stats()["kv_local_blocks_in_use"] > 0
    assert all(engine.abort(i) for i in range(3))
    stats = engine.stats()
    assert stats["kv_blocks_in_use"] == stats["kv_local_blocks_in_use"] == 0


def test_a_prefix_hit_after_its_first_local_blocks_left_the_pool(tiny_gemma3_dir, hf):
    """One sequence at a time, 8-token steps: the local pool holds 8 blocks (and the null block), fewer than the
    40-token shared prefix's 10, so its first local blocks were reused by the first request itself. The second
    request still hits the whole prefix: the global group has all its blocks, the local group the last two, which
    hold every key its first computed position's window reaches."""
    rng = random.Random(9)
    shared = [rng.randrange(384) for _ in range(40)]
    first, second = shared + [1, 2, 3], shared + [rng.randrange(384) for _ in range(5)]
    engine = engine_for(tiny_gemma3_dir, max_num_seqs=1, max_num_batched_tokens=8)
    stats = engine.stats()
    assert stats["kv_local_pool_blocks"] == local_blocks_at_most(WINDOW, BLOCK, 1, 8) == 9
    assert stats["kv_local_pool_blocks"] - 1 < len(shared) // BLOCK
    outputs = run_checked(engine, [Request(0, first, greedy(12))])
    hits = engine.stats()["prefix_cache_hits"]
    outputs.update(run_checked(engine, [Request(1, second, greedy(12))]))
    assert engine.stats()["prefix_cache_hits"] - hits == len(shared)
    prompts = [first, second]
    assert_greedy_matches(hf, prompts, [hf_greedy(hf, p, 12) for p in prompts], [outputs[0][0], outputs[1][0]])


def test_the_padded_decode_path_reads_the_local_tables(tiny_gemma3_dir, hf, cases):
    """The CUDA graphs' padded decode runner (without graphs, on the Triton kernels under the interpreter) stages
    the local group's tables and slots beside the global ones."""
    pytest.importorskip("triton")
    from batchgen.engine.cuda_graphs import DecodeGraphRunner

    prompts, references, tokens = fewer(cases)
    engine = engine_for(tiny_gemma3_dir, attention_backend="triton", max_num_batched_tokens=64)
    graphs = DecodeGraphRunner(engine.model, BLOCK, engine.args.max_num_seqs, engine.max_model_len, engine.device,
                               capture=False, local_group=True)
    engine.runner.decode_graphs = graphs
    outputs = run_checked(engine, [Request(i, p, greedy(tokens)) for i, p in enumerate(prompts)])
    assert_greedy_matches(hf, prompts, references, [outputs[i][0] for i in range(len(prompts))])
    assert sum(graphs.steps_by_size.values()) >= tokens - 2


def test_the_null_block_is_never_read(tiny_gemma3_dir, hf, cases):
    """NaN in the local pool's null block, which every table holds where blocks left the window (and as padding):
    the outputs are still transformers'."""
    prompts, references = cases
    engine = engine_for(tiny_gemma3_dir)
    engine.add_request(Request(-1, [5, 6], greedy(1)))
    engine.step()  # the first step zeroes the blocks handed out so far, the null block among them
    engine.runner.local_kv.tensor[:, :, 0] = float("nan")
    outputs = run_checked(engine, [Request(i, p, greedy()) for i, p in enumerate(prompts)])
    assert_greedy_matches(hf, prompts, references, [outputs[i][0] for i in range(len(prompts))])
    assert torch.isnan(engine.runner.local_kv.tensor[:, :, 0]).all()


# -- the kernels: every implementation skips the blocks before the window -------------------------------------------

def null_block_tables(md: AttentionMetadata, window: int, block_size: int, null: int) -> AttentionMetadata:
    """md with every block-table entry a query of the step cannot reach named `null`: the blocks wholly before
    each sequence's first window, and the padding past its end."""
    table = md.block_tables.clone()
    for row, (q_len, length) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        table[row, :max(length - q_len - window + 1, 0) // block_size] = null
        table[row, -(-length // block_size):] = null
    return AttentionMetadata(**{**md.__dict__, "block_tables": table})


def backends() -> list:
    found = [reference]
    if cpu_backend.available():
        found.append(cpu_backend)
    try:
        from batchgen_kernels import triton_backend
        found.append(triton_backend)
    except ImportError:
        pass
    return found


@pytest.mark.parametrize("window", [7, 40])
def test_no_kernel_reads_a_block_before_the_window(window):
    """Decodes (batched with shorter ones: padding) and prefills after a cached prefix, some chunks longer than
    the window: with a NaN-filled null block in the unreachable entries, each implementation gives the reference's
    output on the real tables."""
    query_lens = [1, 1, 1, 1, 30, 12, window + 20]
    seq_lens = [5, window + 3, 4 * window + 9, 300, 30, 3 * window + 12, 2 * window + 31]
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=16, group=2, head_dim=64, seed=window)
    null = k_cache.shape[0]
    poisoned = [torch.cat([cache, torch.full_like(cache[:1], float("nan"))]) for cache in (k_cache, v_cache)]
    nulled = null_block_tables(md, window, 16, null)
    assert (nulled.block_tables == null).sum() > 20
    expected = reference.paged_attention(q, k_cache, v_cache, md, 0.125, window)
    for backend in backends():
        out = backend.paged_attention(q, *poisoned, nulled, 0.125, window)
        assert torch.isfinite(out).all(), backend.__name__
        assert_close(out, expected)


# -- every account of the pools agrees ----------------------------------------------------------------------------

def test_the_budget_split():
    """Below its cap the local pool has the global pool's blocks and its null block; the global pool gets the rest
    of the budget, which both together never exceed; a large budget caps both."""
    local = LocalLayers(bytes_per_token=768, window=WINDOW)
    pool = size_kv_pool(40 * BLOCK * 256 + 41 * BLOCK * 768 + 100, "'x'", 256, BLOCK, 8, 512, local, 64)
    assert (pool.num_blocks, pool.local.num_blocks) == (40, 41) and pool.bytes <= 40 * 1024 + 41 * 3072 + 100
    cap = local_blocks_at_most(WINDOW, BLOCK, 8, 64)
    assert cap == 8 * (2 + 2) + 2 * 16 + 1  # sequences' windows and a step, a step again, the null block
    big = size_kv_pool(2**20, "'1MiB'", 256, BLOCK, 8, 512, local, 64)
    assert big.local.num_blocks == cap and big.num_blocks == (2**20 - cap * 3072) // 1024
    assert big.bytes <= 2**20 and "65 blocks (max_num_seqs 8 x 4 + 2 64-token steps, and its null block)" in big.reason
    huge = size_kv_pool(2**30, "'1GiB'", 256, BLOCK, 8, 512, local, 64)
    assert huge.num_blocks == 8 * (512 // BLOCK + 1) and huge.local.num_blocks == cap
    assert kv_layout([8, 8, None, 8]).local_layers == (0, 1, 3) and kv_layout([None, None]).local_layers == ()
    assert kv_layout([8, 8]).local_layers == ()  # one kind of layer: one group


def test_stats_and_plan_agree_with_the_engine(tiny_gemma3_dir, default_model_dir, tmp_path):
    """The engine's stats count both pools' bytes; `batchgen plan` sizes the same two pools as the engine and
    counts the local one in its KV estimate."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from batchgen.job import load_job
    from batchgen.job.plan.estimate import make_plan

    model = tmp_path / "model"
    shutil.copytree(tiny_gemma3_dir, model)
    for path in default_model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, model / path.name)
    pq.write_table(pa.table({"id": [0, 1], "prompt": ["Hello there", "A longer prompt than the other one"]}),
                   tmp_path / "in.parquet")
    engine_keys = {"max_num_seqs": 2, "max_num_batched_tokens": 32, "kv_cache_memory": "100KiB", "block_size": BLOCK}
    job = {"model": str(model), "dtype": "float32", "device": "cpu",
           "input": {"path": str(tmp_path / "in.parquet"), "id_column": "id", "chat_template": False},
           "sampling": {"max_tokens": 8}, "engine": engine_keys, "output": {"path": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    plan = make_plan(load_job(tmp_path / "job.yaml"))
    engine = engine_for(model, **engine_keys)
    assert plan.kv_pool == engine.kv_pool and engine.kv_pool.local is not None
    assert plan.kv_local_blocks == min(plan.kv_pool.local.num_blocks, plan.kv_blocks + 1)
    assert plan.memory_parts["kv"] == (plan.kv_blocks * plan.kv_pool.block_bytes
                                       + plan.kv_local_blocks * plan.kv_pool.local.block_bytes)
    run_checked(engine, [Request(i, list(range(3, 60)), greedy()) for i in range(2)])
    stats = engine.stats()
    local_bytes = stats["kv_local_block_bytes"]
    assert local_bytes == BLOCK * 2 * 3 * 2 * 16 * 4  # 3 local layers' K and V
    assert stats["kv_pool_bytes"] == engine.kv_pool.bytes <= 100 * 1024
    assert stats["kv_bytes_touched"] == (stats["kv_blocks_touched"] * stats["kv_block_bytes"]
                                         + stats["kv_local_blocks_touched"] * local_bytes)
    assert stats["kv_peak_bytes_used"] == (stats["kv_peak_blocks_used"] * stats["kv_block_bytes"]
                                           + stats["kv_local_peak_blocks_used"] * local_bytes)
