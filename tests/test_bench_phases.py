"""`batchgen bench --workload realistic` and the phase table (issue 43): the workload's shape, the phase floors'
arithmetic against the step floors of roofline_floor.py, and an end-to-end run on the default model whose phases
are set against the ceilings measured in the same run."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from batchgen.bench.roofline_floor import ModelCounts, decode_floor, decode_phase_floor, prefill_floor
from batchgen.bench.roofline_floor import distinct_prefixes, prefill_phase_floor
from batchgen.bench.workload_realistic import realistic_workload
from batchgen.bench.workloads import shared_prefix_length
from batchgen.cli import main

COUNTS = ModelCounts(num_layers=4, num_heads=8, head_dim=64, matmul_params=50_000_000, lm_head_params=5_000_000,
                     weight_bytes=100_000_000, kv_bytes_per_token=8192)
BANDWIDTH, RATE = 20e9, 500e9


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from batchgen.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


def test_realistic_rows_share_a_system_prompt_and_vary_their_own_text(tokenizer):
    workload = realistic_workload(8, 0, tokenizer)
    shared = shared_prefix_length(workload.rows)
    assert shared >= 60  # the system prompt inside the chat template
    own = [len(row.token_ids) - shared for row in workload.rows]
    assert all(80 <= n <= 140 for n in own) and len(set(own)) > 1
    assert {row.max_tokens for row in workload.rows} == {64} and {row.kind for row in workload.rows} == {"realistic"}
    again = realistic_workload(8, 0, tokenizer)
    assert [row.token_ids for row in again.rows] == [row.token_ids for row in workload.rows]
    assert "support-reply" in " ".join(workload.notes)


def test_phase_floors_are_the_step_floors_summed():
    prompts = [list(range(i * 1000, i * 1000 + 300)) for i in range(4)]  # no token in common
    uniform = prefill_phase_floor(COUNTS, prompts, BANDWIDTH, RATE)
    assert uniform == prefill_floor(COUNTS, 4, 300, BANDWIDTH, RATE)
    shared = prefill_phase_floor(COUNTS, [list(range(100)) + p[100:] for p in prompts], BANDWIDTH, RATE)
    assert shared.flops < uniform.flops
    assert shared.bytes == pytest.approx(uniform.bytes - 300 * COUNTS.kv_bytes_per_token)  # 300 tokens not computed
    assert distinct_prefixes([[1, 2, 3], [1, 2, 4], [1, 5]]) == (5, 1 + 2 + 3 + 3 + 2)
    decode = decode_phase_floor(COUNTS, [300] * 4, [5] * 4, BANDWIDTH, RATE)
    steps = [decode_floor(COUNTS, 4, 300 + step, BANDWIDTH, RATE) for step in range(1, 5)]
    assert decode["steps"] == 4 and decode["floor_s"] == pytest.approx(sum(f.floor_s for f in steps))
    ragged = decode_phase_floor(COUNTS, [300, 300], [5, 2], BANDWIDTH, RATE)  # the second row stops after a step
    assert ragged["steps"] == 4
    assert ragged["floor_s"] == pytest.approx(decode_floor(COUNTS, 2, 301, BANDWIDTH, RATE).floor_s + sum(
        decode_floor(COUNTS, 1, 300 + step, BANDWIDTH, RATE).floor_s for step in range(2, 5)))


def test_bench_reports_each_phase_against_the_measured_roofline(tmp_path, default_model_dir):
    out, archive = tmp_path / "out", tmp_path / "archive.jsonl"
    result = CliRunner().invoke(main, ["bench", "--workload", "realistic", "--rows", "3", "--max-tokens", "4",
                                       "--ignore-eos", "--systems", "batchgen", "--model", str(default_model_dir),
                                       "--out", str(out), "--archive", str(archive)])
    assert result.exit_code == 0, result.output
    record = json.loads(next(out.glob("bench-realistic-*.json")).read_text())
    phases = record["phases"]
    assert phases["bandwidth_bytes_per_s"] == record["bandwidth"]["bytes_per_s"] > 1e9
    assert phases["matmul_flops"] == record["ceiling"]["flops"]
    ours = phases["systems"]["batchgen"]
    floor = phases["prefill_floor"]
    assert floor["floor_s"] == max(floor["bytes"] / phases["bandwidth_bytes_per_s"],
                                   floor["flops"] / phases["matmul_flops"])
    assert ours["prefill_floor_s"] == floor["floor_s"] and ours["decode_floor"]["steps"] == 3
    for key in ("prefill", "decode"):
        assert 0 < ours[f"{key}_floor_s"] < ours[f"{key}_s"]  # nothing beats the roofline
        assert ours[f"{key}_x"] == pytest.approx(ours[f"{key}_s"] / ours[f"{key}_floor_s"])
    assert ours["prefill_s"] + ours["decode_s"] == pytest.approx(record["systems"]["batchgen"]["wall_s"])
    assert ours["wall_x"] > 1
    steps = ours["steps"]
    assert steps["prefill_steps"] >= 1 and steps["decode_steps"] == 3 and steps["decode_tokens"] == 9
    assert 0 < steps["prefill_s"] + steps["decode_s"] <= record["systems"]["batchgen"]["wall_s"]
    assert "x roofline" in result.output and "batchgen by its own steps" in result.output
    assert json.loads(archive.read_text().splitlines()[0])["phases"]["systems"]["batchgen"]["wall_x"] > 1


def test_no_unquantized_floor_for_a_checkpoint_held_in_int8(default_model_dir, default_int8_dir):
    """A converted GGUF runs in int8 whatever the dtype: the unquantized model's roofline is not its floor."""
    from batchgen.bench.phase_report import model_counts

    assert model_counts(str(default_int8_dir), "float32") is None
    assert model_counts(str(default_model_dir), "float32").weight_bytes > 0
