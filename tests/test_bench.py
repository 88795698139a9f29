"""`batchgen bench`: the workloads' shapes, the figures, and end-to-end CLI runs on the default model (3 rows,
shortened max_tokens) writing the record, the chart and the archive."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from batchgen.bench.greedy_check import assert_greedy_matches
from batchgen.bench.hf_static import cut
from batchgen.bench.report import percentiles
from batchgen.bench.workloads import job_workload, shared_prefix_length, synthetic_workload
from batchgen.cli import main


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from batchgen.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


def bench(tmp_path, *args: str):
    out, archive = tmp_path / "out", tmp_path / "archive.jsonl"
    result = CliRunner().invoke(main, ["bench", *args, "--out", str(out), "--archive", str(archive)])
    return result, out, archive


# -- workloads ---------------------------------------------------------------------------------------------------

def test_generation_workload_has_varied_prompts_and_lengths(tokenizer):
    workload = synthetic_workload("generation", 40, seed=1, tokenizer=tokenizer)
    lengths = [len(row.token_ids) for row in workload.rows]
    assert all(50 <= n <= 430 for n in lengths) and max(lengths) - min(lengths) > 200
    assert all(32 <= row.max_tokens <= 256 for row in workload.rows)
    assert len({row.max_tokens for row in workload.rows}) > 10
    text = tokenizer.decode(workload.rows[0].token_ids)
    assert text.startswith("<|im_start|>system") and text.rstrip().endswith("<|im_start|>assistant")


def test_labeling_workload_shares_a_long_instruction(tokenizer):
    workload = synthetic_workload("labeling", 20, seed=0, tokenizer=tokenizer)
    shared = shared_prefix_length(workload.rows)
    assert 230 <= shared <= 280
    own = [len(row.token_ids) - shared for row in workload.rows]
    assert all(80 <= n <= 130 for n in own)
    assert all(row.max_tokens == 8 for row in workload.rows)


def test_a_model_without_a_chat_template_gets_plain_text_with_its_bos(default_model_dir):
    """A base model (Gemma 3 270M's GGUF, for one) has no chat template: the rows are the system text and the
    user's, with the tokenizer's own special tokens, as a job with chat_template: false sends them."""
    from batchgen.models.loader import load_tokenizer

    base = load_tokenizer(default_model_dir)
    base.chat_template = None
    workload = synthetic_workload("labeling", 4, seed=0, tokenizer=base)
    expected = base(["x"], add_special_tokens=True)["input_ids"][0][:-1]  # the tokenizer's own leading tokens
    assert all(row.token_ids[:len(expected)] == expected for row in workload.rows)
    text = base.decode(workload.rows[0].token_ids)
    assert "<|im_start|>" not in text and text.rstrip().endswith("Label:")
    assert shared_prefix_length(workload.rows) > 200 and "no chat template" in workload.notes[0]


def test_workloads_are_deterministic_and_mixed_is_half_and_half(tokenizer):
    first = synthetic_workload("mixed", 10, seed=3, tokenizer=tokenizer)
    again = synthetic_workload("mixed", 10, seed=3, tokenizer=tokenizer)
    other = synthetic_workload("mixed", 10, seed=4, tokenizer=tokenizer)
    assert [r.token_ids for r in first.rows] == [r.token_ids for r in again.rows]
    assert [r.token_ids for r in first.rows] != [r.token_ids for r in other.rows]
    assert sorted(r.kind for r in first.rows) == ["generation"] * 5 + ["labeling"] * 5
    scaled = synthetic_workload("labeling", 2, seed=0, tokenizer=tokenizer, max_tokens_scale=0.25)
    assert [r.max_tokens for r in scaled.rows] == [2, 2]


def test_job_workload_uses_the_job_source(tokenizer):
    workload = job_workload("jobs/labeling.yaml", tokenizer, num_rows=5)
    assert len(workload.rows) == 5 and all(row.max_tokens == 4 for row in workload.rows)  # the job's max_tokens
    assert shared_prefix_length(workload.rows) > 150  # the job's system prompt, through the chat template
    assert "Label:" in tokenizer.decode(workload.rows[0].token_ids)


def test_cut_keeps_the_first_eos_and_the_row_limit():
    assert cut([5, 2, 7, 2], max_tokens=10, eos=[2]) == [5, 2]
    assert cut([5, 6, 7], max_tokens=2, eos=[2]) == [5, 6]
    assert cut([2, 2], max_tokens=1, eos=[2]) == [2]


def test_greedy_check_tolerates_only_near_ties_in_few_prompts():
    class Reference:  # every position: tokens 1 and 2 within 1e-3 of each other, token 3 far below
        device = torch.device("cpu")

        def __call__(self, ids):
            return SimpleNamespace(logits=torch.tensor([0.0, 5.0, 4.9995, 1.0]).expand(1, ids.shape[1], 4))

    prompts, references = [[0]] * 3, [[1, 1]] * 3
    assert assert_greedy_matches(Reference(), prompts, references, [[1, 1], [1, 2], [1, 1]]) == [1]
    for outputs in ([[1, 1], [1, 3], [1, 1]], [[1, 1], [1], [1, 1]]):  # not a tie; stopped early
        with pytest.raises(AssertionError, match="diverged at step 1 without a near-tie"):
            assert_greedy_matches(Reference(), prompts, references, outputs)
    with pytest.raises(AssertionError, match="2 near-tie divergences in 3"):
        assert_greedy_matches(Reference(), prompts, references, [[1, 2], [2, 1], [1, 1]])


def test_percentiles_interpolate():
    p = percentiles([4.0, 1.0, 3.0, 2.0, None])
    assert p == pytest.approx({"p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert percentiles([None]) is None


# -- end to end --------------------------------------------------------------------------------------------------

def test_bench_end_to_end_against_hf_static(tmp_path, default_model_dir):
    """On the default model's fp32 conversion, which both systems load (batchgen's own run of `default` holds int8
    weights, which transformers' greedy texts would not match)."""
    result, out, archive = bench(tmp_path, "--workload", "labeling", "--rows", "3", "--max-tokens-scale", "0.5",
                                 "--systems", "batchgen,hf-static", "--hf-batch-sizes", "2,3",
                                 "--model", str(default_model_dir))
    assert result.exit_code == 0, result.output
    records = list(out.glob("bench-labeling-*.json"))
    charts = list(out.glob("bench-labeling-*.png"))
    assert len(records) == 1 and len(charts) == 1
    assert charts[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads(records[0].read_text())

    ours, hf = record["systems"]["batchgen"], record["systems"]["hf-static"]
    assert ours["available"] and hf["available"]
    assert ours["output_tokens"] > 0 and ours["wall_s"] > 0 and ours["load_s"] > 0
    assert ours["prefix_cache_hit_rate"] > 0.3  # the shared instruction, after the first row
    assert ours["ttft_s"]["p50"] <= ours["ttft_s"]["p99"] and ours["tpot_s"] is not None
    assert ours["peak_rss_bytes"] > 100 * 2**20
    assert hf["details"]["batch_size"] in (2, 3) and set(hf["details"]["runs"]) == {"2", "3"}
    compared = record["comparisons"]["hf-static"]
    assert compared["identical_share"] == 1.0  # greedy: the same token ids on every row
    assert compared["speedup"] == pytest.approx(ours["output_tok_s"] / hf["output_tok_s"])
    assert record["ceiling"]["flops"] > 1e9 and 0 < record["decode"]["share_of_ceiling"] < 1
    assert len(record["rows"]["batchgen"]) == 3

    lines = archive.read_text().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["systems"]["hf-static"]["output_tok_s"] == hf["output_tok_s"] and "rows" not in entry
    assert {"date", "git_commit", "machine", "config"} <= entry.keys() and entry["machine"]["cores"] >= 1

    table = result.output
    assert "hf-static (B=" in table and f"{compared['speedup']:.2f}x" in table and "100%" in table
    assert "machine ceiling" in table and "of the ceiling" in table

    history = CliRunner().invoke(main, ["bench", "--history", "--archive", str(archive)])
    assert history.exit_code == 0, history.output
    assert "labeling" in history.output and "hf-static" in history.output and "batchgen" in history.output
    assert f"{ours['output_tok_s']:,.1f}" in history.output


def test_unavailable_systems_are_reported_not_crashes(tmp_path):
    result, out, archive = bench(tmp_path, "--workload", "labeling", "--rows", "2", "--max-tokens-scale", "0.25",
                                 "--systems", "vllm,hf-continuous", "--hf-continuous-time-limit", "0")
    assert result.exit_code == 0, result.output
    assert "vllm: unavailable" in result.output and "--vllm-python" in result.output
    assert "hf-continuous: unavailable" in result.output
    record = json.loads(next(out.glob("*.json")).read_text())
    assert not record["systems"]["vllm"]["available"] and not record["systems"]["hf-continuous"]["available"]
    assert record["comparisons"] == {} and record["reference"] is None
    assert len(archive.read_text().splitlines()) == 1


def test_bad_options_exit_2(tmp_path):
    result, _, archive = bench(tmp_path, "--systems", "batchgen,nope")
    assert result.exit_code == 2 and "nope" in result.output
    assert not archive.exists()
    missing = CliRunner().invoke(main, ["bench", "--history", "--archive", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 0 and "no archive" in missing.output


def test_choice_system_reports_overhead_and_agreement(tmp_path):
    result, out, _ = bench(tmp_path, "--workload", "labeling", "--rows", "4", "--systems", "batchgen,batchgen-choice")
    assert result.exit_code == 0, result.output
    record = json.loads(next(out.glob("bench-labeling-*.json")).read_text())
    choice = record["systems"]["batchgen-choice"]
    assert choice["available"] and choice["rows"] == 4
    compared = record["comparisons"]["batchgen-choice"]
    assert compared["wall_ratio"] == pytest.approx(choice["wall_s"] / record["systems"]["batchgen"]["wall_s"])
    assert 0 <= compared["reference_exact_label"] <= compared["reference_answers_a_label"] <= 1
    labels = {tuple(ids) for ids in choice["details"]["label_token_ids"].values()}
    assert all(tuple(row["token_ids"]) in labels for row in record["rows"]["batchgen-choice"])
    assert 0.25 <= choice["details"]["mean_confidence"] <= 1
    assert "batchgen-choice: wall" in result.output and "labels agree" in result.output

    generation = bench(tmp_path / "g", "--workload", "generation", "--rows", "2", "--systems", "batchgen-choice")[0]
    assert "batchgen-choice: unavailable" in generation.output and "labeling rows only" in generation.output
