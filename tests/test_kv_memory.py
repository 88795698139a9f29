"""KV memory that follows the job: the pool sized from what can run at once, blocks zeroed on first use so an
unwritten (torch.empty) cache is never read, stale blocks reused safely, and the pool's pages resident only as used."""
import json
import random

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.errors import SettingError
from batchgen.engine.kv_pool import blocks_in_use_at_most, size_kv_pool
from batchgen.job import load_job
from batchgen.job import execute_job, prepare_job


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def make_engine(model_dir, **kwargs):
    args = dict(model=str(model_dir), device="cpu", dtype="float32", kv_cache_memory="32MiB",
                max_num_batched_tokens=512, max_num_seqs=8, enable_prefix_caching=False)
    return Engine(EngineArgs(**{**args, **kwargs}))


def run(engine, prompts, params):
    results = {r.request_id: r for r in engine.generate(Request(i, p, params) for i, p in enumerate(prompts))}
    return [results[i].token_ids for i in range(len(prompts))]


def test_pool_sizing_arithmetic():
    assert blocks_in_use_at_most(4, 100, 16) == 4 * (7 + 1)  # ceil(100 / 16) blocks and one of slack each
    assert blocks_in_use_at_most(1, 16, 16) == 2
    # 1 MiB at 512 B/token holds 128 blocks of 16; 4 x 100-token sequences use at most 32 of them
    capped = size_kv_pool(2**20, "'1MiB'", 512, 16, 4, 100)
    assert (capped.num_blocks, capped.tokens, capped.bytes) == (32, 512, 32 * 16 * 512)
    assert capped.reason == "max_num_seqs 4 x (100-token context + 1 block), under kv_cache_memory '1MiB'"
    budget = size_kv_pool(2**20, "'1MiB'", 512, 16, 64, 100)  # 64 x 8 = 512 blocks > 128: the budget decides
    assert (budget.num_blocks, budget.reason) == (128, "kv_cache_memory '1MiB'")
    with pytest.raises(SettingError, match="fewer than 2 blocks") as info:
        size_kv_pool(8191, "'8191'", 512, 16, 4, 100)
    assert info.value.key == "kv_cache_memory"


def fake_cuda_memory(monkeypatch, free: int, peak: int) -> None:
    """torch.cuda's memory queries answering as a device with `free` bytes free whose profiling step peaks at
    `peak` bytes; the step itself is skipped."""
    from batchgen.engine import gpu_memory

    monkeypatch.setattr(gpu_memory, "run_dummy_step", lambda *args, **kwargs: None)
    answers = {"synchronize": None, "empty_cache": None, "reset_peak_memory_stats": None, "memory_allocated": 0,
               "max_memory_allocated": peak, "mem_get_info": (free, 141 * 2**30)}
    for name, answer in answers.items():
        monkeypatch.setattr(torch.cuda, name, lambda *args, answer=answer, **kwargs: answer)


def test_gpu_pool_capped_at_what_the_job_can_use(monkeypatch):
    """kv_cache_memory unset on CUDA: the budget is 90% of the free device memory less the profiled peak, which for
    the tiny test model on an H200 is ~15 M blocks; the pool is capped by the same rule as on the CPU."""
    from types import SimpleNamespace

    from batchgen.engine.cpu_features import DtypeChoice
    from batchgen.engine.engine_plan import EngineTarget, plan_engine
    from batchgen.engine.gpu_memory import profile_step
    from batchgen.models.inspector import ModelDescription

    free, peak = 130 * 2**30, 2**30
    fake_cuda_memory(monkeypatch, free, peak)
    model = ModelDescription("LlamaForCausalLM", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                             hidden_size=64, intermediate_size=128, vocab_size=384, max_model_len=512)
    target = EngineTarget(torch.device("cuda"), DtypeChoice(torch.float32, "float32: set in dtype"))
    budget_blocks = (int(free * 0.9) - peak) // (16 * 512)  # 512 B/token in fp32
    assert budget_blocks > 14_000_000

    def pool(max_num_seqs):  # the memory figure as the engine measures it (gpu_memory.profile_step, torch faked)
        args = EngineArgs(model="unused", device="cuda", kv_cache_memory=None, max_num_seqs=max_num_seqs)
        return plan_engine(args, model, lambda: profile_step(SimpleNamespace(device=torch.device("cuda")),
                                                             args.max_num_batched_tokens, args.max_num_seqs, 16),
                           target).kv_pool

    capped = pool(16)
    assert capped.num_blocks == blocks_in_use_at_most(16, 512, 16) == 16 * (512 // 16 + 1)
    assert capped.reason.startswith("max_num_seqs 16 x (512-token context + 1 block), under kv_cache_memory from "
                                    "gpu_memory_utilization 0.9")
    uncapped = pool(10**6)  # more sequences than the budget holds: the budget decides
    assert uncapped.num_blocks == budget_blocks and uncapped.reason.startswith("kv_cache_memory from gpu_memory")


def test_engine_pool_capped_by_max_num_seqs_keeps_the_context(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=2)  # 32 MiB would hold 4,096 blocks of 8 KiB
    assert engine.kv_pool.num_blocks == 2 * (512 // 16 + 1)
    assert engine.max_model_len == 512  # still the model's whole context
    stats = engine.stats()
    assert stats["kv_pool_blocks"] == 66 and stats["kv_pool_bytes"] == 66 * 16 * 512
    assert stats["kv_pool_reason"].startswith("max_num_seqs 2 x (512-token context + 1 block)")
    assert stats["kv_peak_blocks_used"] == stats["kv_blocks_touched"] == 0
    run(engine, [[5] * 40, [7] * 20], greedy(8))  # 47 and 27 tokens: 3 + 2 blocks
    stats = engine.stats()
    assert stats["kv_peak_blocks_used"] == 5 and stats["kv_peak_bytes_used"] == 5 * 16 * 512
    assert stats["kv_blocks_touched"] == 5  # never-used blocks go out lowest id first


def test_unwritten_cache_is_never_read(tiny_llama_dir):
    """An empty (unwritten) cache may hold NaN: blocks are zeroed when first handed out, so masked tails and the
    padding of decode batches (block 0) read zeros, and the outputs equal those of a cache that was clean."""
    prompts = [[random.Random(i).randrange(384) for _ in range(3 + 11 * i)] for i in range(5)]
    clean = run(make_engine(tiny_llama_dir), prompts, greedy(12))
    poisoned = make_engine(tiny_llama_dir)
    assert poisoned.runner.num_zeroed_blocks == 0
    poisoned.runner.kv_cache.fill_(float("nan"))
    assert run(poisoned, prompts, greedy(12)) == clean
    touched = poisoned.kv_cache_manager.pool.num_touched
    assert poisoned.runner.num_zeroed_blocks == touched > 0
    assert torch.isnan(poisoned.runner.kv_cache[:, :, touched:]).all()  # the rest was never written


def test_reused_blocks_with_stale_data_give_the_same_outputs(tiny_llama_dir):
    """Long sequences fill the pool and finish; shorter ones then get their blocks, stale K/V in the tails: the
    greedy outputs equal a fresh engine's."""
    rng = random.Random(3)
    long_prompts = [[rng.randrange(384) for _ in range(rng.randint(100, 150))] for _ in range(10)]
    short_prompts = [[rng.randrange(384) for _ in range(rng.randint(2, 30))] for _ in range(6)]
    small = dict(kv_cache_memory=64 * 16 * 512)  # 64 blocks: the long ones use them all
    used = make_engine(tiny_llama_dir, **small)
    run(used, long_prompts, greedy(20))
    assert used.kv_cache_manager.pool.num_touched == 64  # every block has held a long sequence's K/V
    assert run(used, short_prompts, greedy(16)) == run(make_engine(tiny_llama_dir, **small), short_prompts, greedy(16))


def test_resident_memory_follows_the_blocks_used(tiny_llama_dir):
    """A 1 GiB pool (4,096 sequences could fill it) costs next to nothing until its blocks are used."""
    process = psutil.Process()
    before = process.memory_info().rss
    engine = make_engine(tiny_llama_dir, kv_cache_memory="1GiB", max_num_seqs=4096)
    assert engine.kv_pool.bytes == 2**30
    run(engine, [[3] * 100] * 4, greedy(8))
    stats = engine.stats()
    assert stats["kv_bytes_touched"] <= 4 * 8 * 16 * 512
    assert process.memory_info().rss - before < 256 * 2**20  # the model, a step's tensors; not the 1 GiB pool


def test_job_pool_sized_from_its_rows(default_model_dir, tmp_path):
    """A 3-row job gets a pool for 3 sequences, whatever max_num_seqs says; _SUCCESS and the summary say the
    dtype, why, and peak RSS against weights + the KV used + 1 GiB."""
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["Hi", "Name a colour.", "Count to three."]}),
                   tmp_path / "in.parquet")
    job = {"model": str(default_model_dir), "dtype": "float32", "device": "cpu",
           "input": {"path": str(tmp_path / "in.parquet"), "id_column": "id"},
           "sampling": {"max_tokens": 4}, "engine": {"max_num_seqs": 64, "kv_cache_memory": "1GiB", "max_model_len": 1024},
           "output": {"path": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    summary = execute_job(prepare_job(load_job(tmp_path / "job.yaml")))
    stats = summary["engine_stats"]
    assert stats["kv_pool_reason"] == "max_num_seqs 3 x (1,024-token context + 1 block), under kv_cache_memory '1GiB'"
    assert stats["kv_pool_blocks"] == 3 * (64 + 1) and stats["kv_pool_bytes"] == 195 * stats["kv_block_bytes"]
    assert (summary["dtype"], summary["dtype_reason"]) == ("float32", "float32: set in dtype")
    assert summary["memory_bound_bytes"] == stats["weights_bytes"] + stats["kv_bytes_touched"] + 2**30
    assert 0 < stats["kv_blocks_touched"] <= 3 * 4  # short prompts: a few blocks each
    assert summary["peak_memory_bytes"] > stats["weights_bytes"]
    success = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert success["dtype"] == "float32" and success["fingerprint"]["dtype"] == "float32"
