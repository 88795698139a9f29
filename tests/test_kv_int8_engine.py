"""engine.kv_cache_dtype: int8 through the engine and a job: the setting, the halved bytes per token in the plan and
the stats, rows that are the same bits whatever their company with batch_invariant (prefix caching, preemption,
chunked prefills), agreement with the model-dtype cache on the default model, and `batchgen run` to _SUCCESS."""
import json
import subprocess
import sys

import pytest
import torch

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.engine_plan import kv_bytes_per_token
from batchgen.engine.errors import SettingError
from batchgen_kernels import cpu_backend

from conftest import save_tiny_model

pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason="the C++ CPU kernels cannot be built here")
VOCAB, NUM_PROMPTS = 512, 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=384, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return save_tiny_model(config, tmp_path_factory.mktemp("kv_int8_llama"), seed=5)


def prompts():
    """Lengths 5-250; the first 12 share a 64-token prefix (prefix-cache hits)."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(1, VOCAB, (64,), generator=gen).tolist()
    out = []
    for i in range(NUM_PROMPTS):
        own = torch.randint(1, VOCAB, (int(torch.randint(5, 250, (1,), generator=gen)),), generator=gen).tolist()
        out.append(shared + own if i < 12 else own)
    return out


def run(model_dir, **engine):
    args = EngineArgs(model=str(model_dir), device="cpu", dtype="bfloat16", kv_cache_dtype="int8",
                      **{"kv_cache_memory": "16MiB", **engine})
    eng = Engine(args)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {r.request_id: r.token_ids for r in eng.generate(Request(i, p, params) for i, p in enumerate(prompts()))}
    return results, eng.stats()


def test_the_setting_is_checked_by_name():
    with pytest.raises(SettingError, match="kv_cache_dtype must be one of auto, int8; got 'fp8'") as info:
        EngineArgs(kv_cache_dtype="fp8").validate()
    assert info.value.key == "kv_cache_dtype"


def test_bytes_per_token_are_halved_in_the_plan_and_the_stats(model_dir):
    results, stats = run(model_dir, max_num_seqs=NUM_PROMPTS)
    assert stats["kv_cache_dtype"] == "int8" and len(results) == NUM_PROMPTS
    # 2 layers x 2 (K, V) x 2 kv heads x (64 int8 + a 4-byte scale) against 64 bf16 values
    assert stats["kv_bytes_per_token"] == 2 * 2 * 2 * (64 + 4) == 544
    assert stats["kv_block_bytes"] == 16 * 544
    from batchgen.models.inspector import describe_model
    model = describe_model(model_dir)
    assert kv_bytes_per_token(model, torch.int8) / kv_bytes_per_token(model, torch.bfloat16) == 68 / 128


def test_rows_are_the_same_bits_whatever_their_company(model_dir):
    """batch_invariant over an int8 cache: each row through the int8 prefill kernel, its K/V quantized as stored,
    so a row recomputed after a preemption, chunked, or read from the prefix cache gives the bits it gives alone."""
    reference, stats = run(model_dir, batch_invariant=True, max_num_seqs=NUM_PROMPTS)
    assert stats["prefix_cache_hit_rate"] > 0
    for name, variant in {"alone": dict(max_num_seqs=1), "chunked": dict(max_num_batched_tokens=40),
                          "no prefix cache": dict(enable_prefix_caching=False),
                          "preempted": dict(max_num_seqs=12, kv_cache_memory="300KiB")}.items():
        results, stats = run(model_dir, batch_invariant=True, **variant)
        if name == "preempted":
            assert stats["num_preemptions"] > 0, "the pool did not preempt"
        assert results == reference, name


def test_preemption_and_prefix_caching_keep_every_row(model_dir):
    """The default kernels: a pool small enough to preempt, prefix caching on, every row answered in full and the
    pool empty at the end."""
    results, stats = run(model_dir, max_num_seqs=12, kv_cache_memory="300KiB")
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert all(len(results[i]) == 12 for i in range(NUM_PROMPTS)) and stats["kv_blocks_in_use"] == 0


@pytest.mark.slow
def test_agreement_with_the_model_dtype_cache_on_the_default_model(default_model_dir):
    """The bench's labeling workload on the default model's float weights in fp32 (where two attention backends give
    the same rows, so what moves is the cache's doing): choice labels (exact scoring) and free greedy rows with the
    int8 cache against the fp32 one. Every label the fp32 run decides by a margin of 0.05 or more is kept; the floors
    are below what was measured on an AMX Xeon (docs/performance.md, "Issue 43: KV int8": 98% of labels, 88% of rows
    at 128 rows, every decided label kept)."""
    from batchgen.bench.workloads import LABELING_LABELS, synthetic_workload

    outputs = {}
    for kv in ("auto", "int8"):
        engine = Engine(EngineArgs(model=str(default_model_dir), dtype="float32", kv_cache_dtype=kv))
        rows = synthetic_workload("labeling", 64, 0, engine.tokenizer).rows
        free = {r.request_id: r.token_ids for r in engine.generate(
            Request(row.id, row.token_ids, SamplingParams(max_tokens=row.max_tokens, temperature=0.0)) for row in rows)}
        probs = {r.request_id: sorted(r.choice_probs, key=lambda c: -c[1]) for r in engine.generate(
            Request(row.id, row.token_ids, SamplingParams(max_tokens=8, temperature=0.0, choice=LABELING_LABELS))
            for row in rows)}
        outputs[kv] = free, probs
    (free_base, probs_base), (free_int8, probs_int8) = outputs["auto"], outputs["int8"]
    same = {i: probs_base[i][0][0] == probs_int8[i][0][0] for i in probs_base}
    decided = [i for i, p in probs_base.items() if p[0][1] - p[1][1] >= 0.05]
    assert len(decided) >= 48 and all(same[i] for i in decided), [i for i in decided if not same[i]]
    assert sum(same.values()) / len(same) >= 0.95, sum(same.values())
    assert sum(free_base[i] == free_int8[i] for i in free_base) / len(free_base) >= 0.8


def test_a_job_reports_the_halved_bytes_in_success(tmp_path, default_int8_dir):
    import polars as pl

    pl.DataFrame({"prompt": [f"Say hello to {name}." for name in ("Ann", "Bo", "Cy", "Di")]}).write_parquet(
        tmp_path / "in.parquet")
    summaries = {}
    for kv in ("auto", "int8"):
        job = tmp_path / f"{kv}.yaml"
        job.write_text(f"model: default\ndtype: bfloat16\n"
                       f"input: {{path: {tmp_path / 'in.parquet'}, prompt_column: prompt}}\n"
                       f"output: {{path: {tmp_path / kv}}}\nsampling: {{max_tokens: 4, temperature: 0}}\n"
                       f"engine: {{kv_cache_dtype: {kv}, kv_cache_memory: 64MiB}}\n")
        done = subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        summaries[kv] = json.loads((tmp_path / kv / "_SUCCESS").read_text())["engine_stats"]
    assert summaries["int8"]["kv_cache_dtype"] == "int8" and summaries["auto"]["kv_cache_dtype"] == "bfloat16"
    # SmolLM2-135M: 30 layers x 2 x 3 kv heads x (64 + 4) bytes against x 64 x 2 bytes
    assert summaries["int8"]["kv_bytes_per_token"] == 12_240 and summaries["auto"]["kv_bytes_per_token"] == 23_040


def test_plan_advice_reads_this_cpu_kinds_record(tmp_path):
    from batchgen.job.plan.kv_advice import advise_kv_cache
    from batchgen.machine import machine_info

    device = {"type": "cpu", **machine_info()}
    record = {"kind": "kv-int8", "date": "2026-12-05T18:00:00", "machine": machine_info(), "model": "default",
              "dtype": "bfloat16", "decode": {"batch": 16, "context": 4096, "cases": [{"best_ms": 180.0},
                                                                                   {"best_ms": 120.0}]},
              "labeling": {"rows": 200, "cases": [{"generation_s": 60.0}, {"generation_s": 62.0}],
                           "agreement": {"label_share": 0.99, "identical_share": 0.8}}}
    archive = tmp_path / "archive.jsonl"
    archive.write_text(json.dumps(record) + "\n")
    short = advise_kv_cache(archive, device, "auto", 300, pool_limited=False)
    assert "decode step, 16 rows of 4,096 tokens (2026-12-05, model default, bfloat16): 180 ms, int8 120 ms (1.50x)" \
        in short[1]
    assert "the same choice label on 99% of rows, the same free greedy text on 80%" in short[2]
    other = {**record, "model": "gemma3-270m", "date": "2026-12-06T00:00:00", "decode": None}
    other["labeling"] = {**record["labeling"], "agreement": {"label_share": 0.9, "identical_share": 0.8,
                                                             "decided_labels": 9, "decided_same_labels": 9}}
    archive.write_text(json.dumps(record) + "\n" + json.dumps({k: v for k, v in other.items() if v}) + "\n")
    both = advise_kv_cache(archive, device, "auto", 300, pool_limited=False)
    assert "(1.50x)" in both[1] and "model default" in both[2]  # the default model's labeling wins, older or not
    other["model"] = "default"
    archive.write_text(json.dumps(record) + "\n" + json.dumps({k: v for k, v in other.items() if v}) + "\n")
    newer = advise_kv_cache(archive, device, "auto", 300, pool_limited=False)
    assert "(1.50x)" in newer[1] and "90% of rows (9/9 of those not near a tie)" in newer[2]
    archive.write_text(json.dumps(record) + "\n")
    assert short[-1].strip().startswith("engine.kv_cache_dtype: int8 would not pay for this job")
    assert "would pay" in advise_kv_cache(archive, device, "auto", 3000, pool_limited=False)[-1]
    assert "pays for this job: the KV pool limits" in advise_kv_cache(archive, device, "int8", 300, True)[-1]
    assert advise_kv_cache(tmp_path / "none.jsonl", device, "auto", 300, False) == []


@pytest.mark.parametrize("fixture,impl", [("tiny_gemma3_dir", "auto"), ("tiny_llama_dir", "transformers")])
def test_sliding_windows_and_the_generic_path(request, fixture, impl):
    """Gemma 3's sliding-window layers (their own KV group and pool, int8 too) and the generic path (transformers'
    modeling code on the engine): int8 KV runs, and with batch_invariant a row alone is the row in a batch."""
    model = request.getfixturevalue(fixture)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 300, (int(n),), generator=gen).tolist() for n in (5, 90, 200, 150)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def generate(**engine):
        eng = Engine(EngineArgs(model=str(model), dtype="float32", kv_cache_dtype="int8", kv_cache_memory="8MiB",
                                batch_invariant=True, model_impl=impl, **engine))
        out = {r.request_id: r.token_ids for r in eng.generate(Request(i, p, params) for i, p in enumerate(prompts))}
        assert eng.stats()["kv_cache_dtype"] == "int8"
        return out

    together = generate()
    assert all(len(ids) == 8 for ids in together.values())
    assert generate(max_num_seqs=1) == together


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_the_plan_takes_it_on_cuda_with_the_triton_kernels(backend):
    """The Triton kernels read the int8 cache (tests/test_triton_int8.py): a CUDA plan with them, or with auto or the
    torch reference, is int8 at 2 x layers x kv heads x (head dim + 4 scale bytes) per token."""
    from batchgen.engine.cpu_features import DtypeChoice
    from batchgen.engine.engine_plan import EngineTarget, kv_cache_dtype, plan_engine
    from batchgen.models.inspector import ModelDescription
    from batchgen_kernels import BackendChoice

    cuda = EngineTarget(torch.device("cuda"), DtypeChoice(torch.bfloat16, "bfloat16: auto on CUDA"))
    model = ModelDescription("LlamaForCausalLM", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                             hidden_size=256, intermediate_size=512, vocab_size=384, max_model_len=512)
    args = EngineArgs(model="unused", device="cuda", kv_cache_dtype="int8", attention_backend=backend,
                      kv_cache_memory="4MiB")
    attention = BackendChoice("triton" if backend != "torch" else "torch", "test")
    plan = plan_engine(args, model, target=cuda, attention=attention)
    assert plan.cache_dtype == torch.int8 and plan.kv_bytes_per_token == 2 * 2 * 2 * (64 + 4)
    assert kv_cache_dtype(args, cuda) == torch.int8
    assert kv_cache_dtype(EngineArgs(attention_backend=backend), cuda) == torch.bfloat16


def test_n_samples_fork_the_int8_blocks_and_their_scales(model_dir):
    """n samples share the prompt's blocks and copy its partial last block (K/V and scales) for each sample: with a
    fixed seed per sample the answers are those of the same rows asked one sample at a time."""
    prompt = list(range(1, 40))  # 39 tokens: a partial last block, copied on write

    def sample(n, seed):
        eng = Engine(EngineArgs(model=str(model_dir), device="cpu", dtype="float32", kv_cache_dtype="int8",
                                kv_cache_memory="8MiB", batch_invariant=True))
        params = SamplingParams(max_tokens=10, temperature=0.9, n=n, seed=seed, ignore_eos=True)
        return [r.token_ids for r in sorted(eng.generate([Request(0, prompt, params)]), key=lambda r: r.sample_index)]

    both = sample(2, 7)
    assert len(both) == 2 and both[0] == sample(1, 7)[0]
