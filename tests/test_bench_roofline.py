"""`batchgen bench --roofline`: the floor arithmetic on hand-computed numbers, the parameter counts of tied and untied
tiny models, and a whole roofline run on a tiny random model (tiny batches and contexts): the record's structure,
its arithmetic, the table, the archive line and the history. No timing is asserted."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from batchgen.bench.roofline import RooflineConfig, run_roofline
from batchgen.bench.roofline_floor import ModelCounts, decode_floor, prefill_floor
from batchgen.bench.roofline_report import format_roofline
from batchgen.bench.report import history_table
from batchgen.cli import main
from batchgen.engine.model_runner import ModelRunner

COUNTS = ModelCounts(num_layers=2, num_heads=4, head_dim=16, matmul_params=1000, lm_head_params=100,
                     weight_bytes=4000, kv_bytes_per_token=256)


def test_decode_floor_is_the_larger_of_bytes_over_bandwidth_and_flops_over_rate():
    # bytes: 4000 weights + 2 x 10 x 256 KV = 9120; FLOPs: 2 x 1000 x 2 + 4 x 2 x 4 x 16 x 10 x 2 = 4000 + 10240
    floor = decode_floor(COUNTS, batch=2, context=10, bandwidth=1000.0, flop_rate=10000.0)
    assert (floor.bytes, floor.flops) == (9120, 14240)
    assert floor.memory_s == pytest.approx(9.12) and floor.compute_s == pytest.approx(1.424)
    assert floor.floor_s == pytest.approx(9.12) and floor.bound == "memory"
    fast_memory = decode_floor(COUNTS, batch=2, context=10, bandwidth=1e6, flop_rate=10000.0)
    assert fast_memory.floor_s == pytest.approx(1.424) and fast_memory.bound == "compute"


def test_the_serial_floor_adds_up_each_phase_on_its_own():
    # At 1000 B/s and 1500 FLOP/s: linear layers 4000 bytes = 4.0 s against 4000 FLOPs = 2.67 s (memory-bound);
    # attention 5120 bytes = 5.12 s against 10240 FLOPs = 6.83 s (compute-bound). Overlapped, the floor is
    # max(9.12, 9.49); one phase after the other, 4.0 + 6.83.
    floor = decode_floor(COUNTS, batch=2, context=10, bandwidth=1000.0, flop_rate=1500.0)
    assert floor.floor_s == pytest.approx(14240 / 1500)
    assert floor.serial_s == pytest.approx(4.0 + 10240 / 1500)
    # Both phases bound by the same resource: the sum is the floor.
    floor = decode_floor(COUNTS, batch=2, context=10, bandwidth=1000.0, flop_rate=1e6)
    assert floor.serial_s == pytest.approx(floor.floor_s) == pytest.approx(9.12)


def test_prefill_floor_counts_the_lm_head_once_per_sequence_and_causal_attention():
    # 2 sequences of 3 tokens: 2 x 900 x 6 + 2 x 100 x 2 + 4 x 2 x 4 x 16 x (2 x 3 x 4 / 2) = 10800 + 400 + 6144
    floor = prefill_floor(COUNTS, num_seqs=2, seq_len=3, bandwidth=1e9, flop_rate=1000.0)
    assert floor.flops == 17344 and floor.bytes == 4000 + 6 * 256
    assert floor.floor_s == pytest.approx(17.344) and floor.bound == "compute"
    assert floor.serial_s == pytest.approx(17.344)  # compute-bound in both phases: the sum is the same


@pytest.mark.parametrize("fixture, expected", [
    # per layer: qkv 64 x 128, o 64 x 64, gate/up 64 x 256, down 128 x 64, 2 norms of 64 = 36,992; final norm 64;
    # LM head 384 x 64 = 24,576. Untied Llama: its embedding table is left out. Tied Qwen2: the table is the LM
    # head, counted once; its q/k/v biases add 128 per layer.
    ("tiny_llama_dir", 2 * 36992 + 64 + 24576),
    ("tiny_qwen2_dir", 2 * (36992 + 128) + 64 + 24576),
])
def test_model_counts_leave_out_the_embedding_but_keep_the_lm_head(request, fixture, expected):
    from batchgen.engine import EngineArgs
    from batchgen.engine.startup import set_up

    for dtype in ("float32", "bfloat16"):  # weights packed where oneDNN takes them: counted at their real size
        setup = set_up(EngineArgs(model=str(request.getfixturevalue(fixture)), dtype=dtype, kv_cache_memory="1MiB"))
        counts = ModelCounts.of(setup, kv_bytes_per_token=512)
        assert counts.matmul_params == expected and counts.lm_head_params == 384 * 64
        assert counts.weight_bytes == expected * getattr(torch, dtype).itemsize
        assert (counts.num_layers, counts.num_heads, counts.head_dim) == (2, 4, 16)


def test_roofline_run_on_a_tiny_model(tiny_llama_dir, tmp_path, monkeypatch):
    steps = []
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, scheduled: steps.append(dict(scheduled))
                        or execute(self, scheduled))
    # KV per token: 2 layers x 2 x 2 kv heads x 16 x 4 bytes = 512 (fp32), 256 (bf16); blocks of 16 tokens. The cap
    # of 40,000 bytes leaves out B=3 at context 40 in fp32 (3 x 48 x 512 = 73,728) but not in bf16 (36,864);
    # context 1000 is past the model's 512 positions.
    config = RooflineConfig(model=str(tiny_llama_dir), dtypes=("float32", "bfloat16"), batches=(1, 3),
                            contexts=(5, 40, 1000), prefill_seqs=2, prefill_len=24, warmup=1, reps=2,
                            kv_cache_memory=40000, bandwidth_bytes=2**24, matmul_n=128,
                            out_dir=str(tmp_path / "out"), archive=str(tmp_path / "archive.jsonl"))
    record = run_roofline(config, log=lambda line: None)

    assert record["kind"] == "roofline" and set(record["rates"]["matmul"]) == {"float32", "bfloat16"}
    assert record["rates"]["memory"]["bytes_per_s"] > 0 and "avx2" in record["machine"]["cpu_flags"]
    assert [(c["dtype"], c["batch"], c["context"]) for c in record["decode"]] == [
        (dtype, batch, context) for dtype in ("float32", "bfloat16") for context in (5, 40, 1000)
        for batch in (1, 3)]
    skipped = {(c["dtype"], c["batch"], c["context"]): c["skipped"] for c in record["decode"] if "skipped" in c}
    assert set(skipped) == {("float32", 3, 40)} | {(d, b, 1000) for d in ("float32", "bfloat16") for b in (1, 3)}
    assert "--kv-cache-memory" in skipped[("float32", 3, 40)] and "512 positions" in skipped[("float32", 1, 1000)]

    bandwidth = record["rates"]["memory"]["bytes_per_s"]
    for dtype, model in record["models"].items():
        counts = ModelCounts(**model["counts"])
        assert counts.kv_bytes_per_token == 2 * 2 * 2 * 16 * torch.finfo(getattr(torch, dtype)).bits // 8
        rate = record["rates"]["matmul"][dtype]["flops"]
        for case in (c for c in record["decode"] if c["dtype"] == dtype):
            floor = decode_floor(counts, case["batch"], case["context"], bandwidth, rate)
            assert case["floor"]["floor_s"] == pytest.approx(floor.floor_s)
            assert case["floor"]["floor_s"] == max(case["floor"]["memory_s"], case["floor"]["compute_s"])
            assert case["floor"]["serial_s"] == pytest.approx(floor.serial_s)
            assert case["floor"]["serial_s"] >= case["floor"]["floor_s"] * (1 - 1e-12)
            if "skipped" not in case:
                assert case["best_s"] == min(case["times_s"]) and len(case["times_s"]) == 2
                assert case["ratio"] == pytest.approx(case["best_s"] / case["floor"]["floor_s"])
                assert case["target"] == 2.0  # batch < 32
        prefill = next(p for p in record["prefill"] if p["dtype"] == dtype)
        assert prefill["tokens"] == 48 and prefill["floor"]["flops"] == prefill_floor(counts, 2, 24, 1, 1).flops
        assert prefill["share_of_matmul"] == pytest.approx(prefill["floor"]["flops"] / prefill["best_s"] / rate)

    # Every timed step went through the engine's ModelRunner: 3 + 4 decode cases and 2 prefills, 3 steps each.
    assert len(steps) == (3 + 4 + 2) * 3
    decodes = [s for s in steps if set(s.values()) == {1}]
    assert all(seq.num_computed_tokens == seq.num_tokens - 1 for step in decodes for seq in step)
    blocks = [seq.block_ids.array.tolist() for seq in next(s for s in decodes if len(s) == 3)]
    assert len({b for ids in blocks for b in ids}) == sum(len(ids) for ids in blocks)  # distinct blocks
    assert [len(s) for s in steps if set(s.values()) == {24}] == [2] * 6

    table = format_roofline(record)
    for text in ("best ms", "floor ms", "x floor", "memory read", "bf16", "fp32 2 x 24 tokens", "skipped",
                 f"{record['decode'][0]['ratio']:.2f}x", "targets: decode <= 1.5x", "serial ms", "x serial",
                 f"{record['decode'][0]['best_s'] / record['decode'][0]['floor']['serial_s']:.2f}x"):
        assert text in table
    archived = json.loads((tmp_path / "archive.jsonl").read_text())
    assert archived["kind"] == "roofline" and archived["decode"] == record["decode"] and "paths" not in archived
    assert json.loads(open(record["paths"]["record"]).read())["prefill"] == record["prefill"]
    history = history_table(tmp_path / "archive.jsonl")
    assert "roofline" in history and "fp32" in history and "bf16" in history


def test_roofline_cli_and_its_bad_options(tiny_llama_dir, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {tiny_llama_dir}\ninput:\n  path: data/samples/prompts.parquet\n"
                   f"output:\n  path: {tmp_path}/o\n")
    out, archive = tmp_path / "out", tmp_path / "archive.jsonl"
    common = ["bench", str(job), "--roofline", "--out", str(out), "--archive", str(archive)]
    result = CliRunner().invoke(main, common + ["--dtype", "float32", "--roofline-batches", "2",
                                                "--roofline-contexts", "17", "--roofline-prefill", "1x20",
                                                "--roofline-reps", "1"])
    assert result.exit_code == 0, result.output
    record = json.loads(next(out.glob("roofline-*.json")).read_text())
    assert record["model"] == str(tiny_llama_dir) and list(record["rates"]["matmul"]) == ["float32"]
    assert [(c["batch"], c["context"]) for c in record["decode"]] == [(2, 17)] and "fp32 1 x 20 tokens" in result.output
    bad = CliRunner().invoke(main, common + ["--roofline-prefill", "4 by 1024"])
    assert bad.exit_code == 2 and "--roofline-prefill" in bad.output
    bad = CliRunner().invoke(main, common + ["--roofline-batches", "0"])
    assert bad.exit_code == 2 and "--roofline-batches" in bad.output
