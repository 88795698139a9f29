"""The encoder engine's public API (Engine's: add_request, step, abort, has_unfinished, generate, stats): error
results, truncation, packing by the token budget, abort, lazy generate, and a row's embedding the same bits
whatever batch it ran in."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine import EngineArgs, PoolingParams, Request, SettingError, open_engine
from batchgen.engine.encoder_engine import EncoderEngine

from encoder_cases import random_rows, save_tiny_encoder

# the keys the job layer reads from Engine.stats() (runner, run_summary, timeline, progress_log, metrics)
JOB_STATS_KEYS = {"dtype", "dtype_reason", "model_path", "architecture", "attention_backend_reason", "weights_bytes",
                  "kv_bytes_touched", "kv_pool_bytes", "kv_pool_reason", "kv_peak_bytes_used", "kv_pool_blocks",
                  "kv_blocks_in_use", "kv_block_bytes", "num_results", "num_sampled_tokens", "num_steps",
                  "step_seqs_sum", "step_tokens_sum", "num_running", "num_waiting", "num_preemptions",
                  "prefix_cache_queries", "prefix_cache_hits", "rss_bytes", "peak_memory_bytes",
                  "step_seconds_counts", "step_seconds_buckets", "step_seconds_sum"}


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory, minilm_dir):
    path = tmp_path_factory.mktemp("tiny_bert")
    save_tiny_encoder(path, "bert", "BertModel", minilm_dir)  # 160 positions: prompts cut at 160 tokens
    return path


def engine_for(path, **fields) -> EncoderEngine:
    return open_engine(EngineArgs(model=str(path), task=fields.pop("task", "embed"), dtype="float32", **fields))


def test_bad_requests_are_error_results(tiny_bert_dir):
    engine = engine_for(tiny_bert_dir)
    good = [101, 2000, 102]
    bad = {"empty": ([], None, "empty prompt"), "negative": ([101, -1, 102], None, "integers in [0, 30522)"),
           "beyond": ([101, 30522], None, "integers in [0, 30522)"), "text": ([101, "x"], None, "integers"),
           "long": ([101] * 200, PoolingParams(truncate=False), "too long: 200 tokens"),
           "pooling": (good, PoolingParams(pooling="max"), "pooling must be one of"),
           "dims": (good, PoolingParams(dimensions=33), "dimensions must be an integer in [1, 32]"),
           "normalize": (good, PoolingParams(normalize="yes"), "normalize must be true or false")}
    for name, (ids, params, _) in bad.items():
        engine.add_request(Request(name, ids, pooling_params=params))
    engine.add_request(Request("ok", good))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request(Request("ok", good))
    results = {r.request_id: r for r in engine.step()}
    assert set(results) == {*bad, "ok"}
    for name, (_, _, message) in bad.items():
        assert results[name].finish_reason == "error" and message in results[name].error
        assert results[name].embedding is None
    ok = results["ok"]
    assert ok.error is None and ok.finish_reason == "stop" and len(ok.embedding) == 32
    assert ok.text == "" and ok.token_ids == [] and ok.output_tokens == 0 and ok.prompt_tokens == 3
    assert ok.arrival_time <= ok.first_scheduled_time <= ok.first_token_time == ok.finish_time
    assert not engine.has_unfinished() and engine.step() == []


@pytest.mark.parametrize("task", ["generate", "score", "classify"])
def test_tasks_an_encoder_cannot_run_refuse_to_start(tiny_bert_dir, task):
    with pytest.raises(SettingError) as refused:
        engine_for(tiny_bert_dir, task=task)
    assert refused.value.key == "task" and "task" in str(refused.value)


def test_truncation_keeps_the_end_token(tiny_bert_dir):
    engine = engine_for(tiny_bert_dir)
    assert engine.max_model_len == 160
    long = random_rows(1, 300, 300, seed=7)[0]  # ends with [SEP]
    plain = long[:-1]  # ends with an ordinary token: cut to the first 160
    cut = embed_all(engine, [long, long[:159] + [102], plain, plain[:160]])
    assert cut[0].num_truncated_tokens == 140 and cut[0].prompt_tokens == 160
    assert cut[0].embedding == cut[1].embedding and cut[1].num_truncated_tokens == 0
    assert cut[2].num_truncated_tokens == 139 and cut[2].embedding == cut[3].embedding
    assert engine.stats()["num_truncated_tokens"] == 279


def embed_all(engine, rows, params=None) -> list:
    results = {r.request_id: r for r in engine.generate(Request(i, row, pooling_params=params)
                                                        for i, row in enumerate(rows))}
    return [results[i] for i in range(len(rows))]


def test_steps_pack_by_token_budget_and_rows(tiny_bert_dir):
    engine = engine_for(tiny_bert_dir, max_num_batched_tokens=100, max_num_seqs=4)
    rows = random_rows(30, 2, 60, seed=8)
    for i, row in enumerate(rows):
        engine.add_request(Request(i, row))
    done, oldest_step = [], None
    while engine.has_unfinished():
        results = engine.step()
        ids = [r.request_id for r in results]
        shape = engine.last_step
        assert shape.num_seqs == len(ids) <= 4
        assert shape.num_prefill_tokens == sum(len(rows[i]) for i in ids)
        assert shape.num_prefill_tokens <= 100 or len(ids) == 1
        lengths = sorted(len(rows[i]) for i in ids)  # a run of neighbours in length order
        assert not any(lengths[0] < len(rows[j]) < lengths[-1] for j in range(len(rows)) if j not in done + ids)
        if 0 in ids:
            oldest_step = engine.num_steps
        done += ids
    assert sorted(done) == list(range(30)) and oldest_step == 1
    stats = engine.stats()
    assert JOB_STATS_KEYS <= stats.keys()
    assert stats["num_results"] == 30 and stats["kv_pool_blocks"] == 0 and stats["model_path"] == "native"
    assert stats["step_tokens_sum"] == sum(map(len, rows))


def test_abort_and_lazy_generate(tiny_bert_dir):
    engine = engine_for(tiny_bert_dir, max_num_seqs=3)
    rows = random_rows(3, 4, 9, seed=9)
    for i, row in enumerate(rows):
        engine.add_request(Request(i, row))
    assert engine.abort(1) and not engine.abort(1) and not engine.abort("unknown")
    assert sorted(r.request_id for r in engine.step()) == [0, 2] and not engine.has_unfinished()
    pulled = []

    def requests():
        for i, row in enumerate(random_rows(10, 4, 9, seed=10)):
            pulled.append(i)
            yield Request(i, row)

    stream = engine.generate(requests())
    next(stream)
    assert len(pulled) <= 4  # no more than max_num_seqs waiting (and the one that ended the pull)
    assert len(list(stream)) == 9 and len(pulled) == 10


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_embedding_does_not_depend_on_its_batch(minilm_dir, dtype):
    """A resumed job batches other rows together: each row's bits must be the same as in the uninterrupted run."""
    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 on this CPU")
    engine = open_engine(EngineArgs(model="all-minilm-l6-v2", task="embed", dtype=dtype))
    rows = random_rows(14, 2, 80, seed=11)
    rows += [rows[3][:], rows[5][:]]  # equal lengths share an attention call
    together = embed_batches(engine, [list(range(len(rows)))], rows)
    assert engine.num_steps == 1
    shuffled = list(range(len(rows)))[::-1][::2] + list(range(len(rows)))[::-1][1::2]
    apart = embed_batches(engine, [shuffled[i:i + 3] for i in range(0, len(rows), 3)] + [[0], [3]], rows)
    assert engine.num_steps == 9
    assert together == apart


def embed_batches(engine, batches: list[list[int]], rows) -> dict:
    """Each batch of row indices added, then run in one step: row index -> its embedding (the last one run)."""
    out = {}
    for batch in batches:
        for i in batch:
            engine.add_request(Request(i, rows[i]))
        results = engine.step()
        assert sorted(r.request_id for r in results) == sorted(batch)
        out.update((r.request_id, r.embedding) for r in results)
    return out
