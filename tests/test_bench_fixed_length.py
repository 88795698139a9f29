"""`batchgen bench` at a realistic size: --model (the rows tokenized with that model's tokenizer), the fixed-length
mode (--ignore-eos, --max-tokens: random weights serve), and start-up measured in a fresh process beside each
system. A model whose EOS is the very token greedy decoding picks first shows that every system ignores it."""
from __future__ import annotations

import json
import shutil
import sys
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from batchgen.bench import batchgen_system, hf_static
from batchgen.bench.startup_probe import measure
from batchgen.bench.system_types import BenchOptions
from batchgen.cli import main
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from conftest import _TINY, save_tiny_model
from test_plan import write_input, write_job

PROMPT = [5, 17, 99, 230, 41, 8]


@pytest.fixture(scope="module")
def tiny_chat_model(default_model_dir, tmp_path_factory):
    """A tiny random Llama over the default model's whole vocabulary, with its tokenizer and chat template: what
    `dev/make_random_model.py` makes at real sizes, small enough for a test."""
    from transformers import LlamaConfig

    model = tmp_path_factory.mktemp("tiny_chat_full_vocab")
    config = LlamaConfig(**{**_TINY, "vocab_size": 49152}, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    save_tiny_model(config, model)
    for path in default_model_dir.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(path, model / path.name)
    return model


def bench(tmp_path, *args: str):
    out, archive = tmp_path / "out", tmp_path / "archive.jsonl"
    result = CliRunner().invoke(main, ["bench", *args, "--out", str(out), "--archive", str(archive)])
    return result, out


def test_fixed_length_bench_on_a_model_directory(tmp_path, tiny_chat_model):
    result, out = bench(tmp_path, "--model", str(tiny_chat_model), "--workload", "generation", "--rows", "3",
                        "--max-tokens", "5", "--ignore-eos", "--systems", "batchgen,hf-static",
                        "--hf-batch-sizes", "3")
    assert result.exit_code == 0, result.output
    record = json.loads(next(out.glob("bench-generation-*.json")).read_text())
    assert record["workload"]["model"] == str(tiny_chat_model)
    assert record["config"]["ignore_eos"] is True and record["config"]["max_tokens"] == 5
    for name in ("batchgen", "hf-static"):  # exactly max_tokens a row, whatever the random model says
        assert [row["output_tokens"] for row in record["rows"][name]] == [5, 5, 5]
    assert record["comparisons"]["hf-static"]["identical_share"] == 1.0  # greedy ids still comparable
    ours = record["systems"]["batchgen"]
    startup = ours["details"]["startup"]
    assert ours["startup_s"] == startup["startup_s"] > 0
    assert startup["startup_s"] == pytest.approx(startup["process_to_module_s"] + startup["imports_s"]
                                                 + startup["engine_s"])
    assert startup["imports_s"] > 0 and startup["engine_s"] > 0 and startup["first_request_s"] > 0
    assert record["systems"]["hf-static"]["startup_s"] is None  # measured in-process only: no start-up figure
    assert "exactly 5 tokens a row (ignore_eos)" in result.output and f"model {tiny_chat_model}" in result.output
    assert "start s" in result.output and "a fresh process, from its spawn to ready" in result.output


@pytest.fixture(scope="module")
def eos_first_model(tiny_chat_model, tmp_path_factory):
    """The tiny model with its EOS set to the token greedy decoding picks first after PROMPT: it stops at once
    unless EOS is ignored."""
    engine = Engine(EngineArgs(model=str(tiny_chat_model), dtype="float32", kv_cache_memory="16MiB"))
    first = next(iter(engine.generate([Request(0, PROMPT, SamplingParams(max_tokens=1, temperature=0.0,
                                                                           ignore_eos=True))]))).token_ids[0]
    model = tmp_path_factory.mktemp("eos_first")
    for path in tiny_chat_model.iterdir():
        shutil.copy(path, model / path.name)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    return model, first


@pytest.mark.parametrize("system", ["batchgen", "hf-static"])
def test_ignore_eos_runs_past_the_eos_greedy_picks(eos_first_model, system):
    model, eos = eos_first_model
    rows = [SimpleNamespace(id=0, token_ids=PROMPT, max_tokens=6, kind="generation")]
    outputs = {}
    for ignore_eos in (False, True):
        options = BenchOptions(EngineArgs(model=str(model), dtype="float32", kv_cache_memory="16MiB"),
                               hf_batch_sizes=(1,), ignore_eos=ignore_eos)
        run = (batchgen_system.run(rows, options, prefix_caching=True) if system == "batchgen"
               else hf_static.run(rows, options))
        assert run.available, run.reason
        outputs[ignore_eos] = run.rows[0].token_ids
    assert outputs[False] == [eos]  # stopped on it
    assert len(outputs[True]) == 6 and outputs[True][0] == eos  # generated it and went on


def test_ignore_eos_reaches_the_vllm_worker(tmp_path, tiny_llama_dir):
    """What the worker is given (a stand-in that echoes its spec): ignore_eos, and the start-up figure from the
    ready time it reports."""
    from batchgen.bench import vllm_system

    (tmp_path / "worker.py").write_text(ECHO_WORKER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'worker.py'} \"$@\"\n")
    python.chmod(0o755)
    rows = [SimpleNamespace(id=0, token_ids=[5, 6, 7], max_tokens=4)]
    run = vllm_system.run(rows, BenchOptions(EngineArgs(model=str(tiny_llama_dir)), vllm_python=str(python),
                                             ignore_eos=True))
    assert run.available, run.reason
    assert run.details["vllm_version"] == "echo ignore_eos=True"
    assert 0 < run.startup_s < run.details["process_s"]


ECHO_WORKER = """
import json, sys, time
spec = json.load(open(sys.argv[2]))
rows = [{"id": r["id"], "token_ids": [1] * r["max_tokens"], "num_cached_tokens": 0, "first_token_s": 0.01,
         "finish_s": 0.02} for r in spec["rows"]]
ready = time.monotonic()
time.sleep(0.2)
json.dump({"vllm_version": f"echo ignore_eos={spec['ignore_eos']}", "load_s": 0.1, "ready_monotonic": ready,
           "wall_s": 0.2, "rows": rows}, open(sys.argv[3], "w"))
"""


def test_startup_probe_on_its_own(tiny_llama_dir):
    figures = measure(EngineArgs(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB"))
    assert figures["startup_s"] > figures["engine_s"] > 0 and figures["one_time"] == []
    with pytest.raises(RuntimeError, match="start-up probe exited"):
        measure(EngineArgs(model=str(tiny_llama_dir / "missing")))


def test_bad_fixed_length_and_model_options_exit_2(tmp_path, tiny_chat_model):
    job = write_job(tmp_path, tiny_chat_model, write_input(tmp_path / "in.parquet", ["Hello there"]))
    for args, words in [(["--max-tokens", "0"], "--max-tokens"), ([str(job), "--model", "default"], "--model"),
                        (["--roofline", str(job), "--model", "default"], "--model"),
                        (["--roofline", "--quantization", "none,int4"], "--quantization"),
                        (["--quantization", "int4"], "--quantization"),
                        (["--quantization", "int8-weight-only", "--dtype", "float32"], "bfloat16")]:
        result, _ = bench(tmp_path, *args)
        assert result.exit_code == 2 and words in result.output, (args, result.output)


def test_a_slow_matmul_ceiling_is_timed_twice(monkeypatch):
    """bf16 without native bf16 runs a 2048 matmul in about a minute: the ceiling then takes 2 timings, not 5."""
    from batchgen.bench import ceiling

    monkeypatch.setattr(ceiling, "SLOW_MATMUL_S", 0.0)
    assert ceiling.matmul_flops(64, reps=5)["reps"] == 2
    monkeypatch.setattr(ceiling, "SLOW_MATMUL_S", 1e9)
    assert ceiling.matmul_flops(64, reps=5)["reps"] == 5
