"""`batchgen bench --workload lora` (issue 42's bench), tiny: a random Llama over the default model's tokenizer, a few
rows over random adapters, the three systems side by side. What is checked is the table, the record and the archive
line, and the agreement of every adapter row with its merged model (fp32): not the timings."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from batchgen.bench.lora_bench import LoraBenchConfig, parse_lora_options, run_lora_bench
from batchgen.cli import main
from batchgen.lora.random_adapter import write_adapter
from test_bench_tasks import tiny_causal_lm  # noqa: F401 (a fixture: a tiny Llama with the default tokenizer)

SYSTEMS = ("base", "batchgen-lora", "merged-sequential")


@pytest.fixture(scope="module")
def tiny_chat_lm(tiny_causal_lm, default_model_dir, tmp_path_factory):
    """The tiny Llama with the default model's chat template too: the workload's prompts are chat prompts."""
    model = tmp_path_factory.mktemp("bench_lora") / "tiny-chat"
    shutil.copytree(tiny_causal_lm, model)
    for template in default_model_dir.glob("chat_template*"):
        shutil.copy(template, model / template.name)
    return model


def bench(tmp_path, model, *options: str):
    archive = tmp_path / "archive.jsonl"
    result = CliRunner().invoke(main, ["bench", "--workload", "lora", "--model", str(model), "--rows", "8",
                                       "--max-tokens", "5", "--kv-cache-memory", "64MiB", "--out",
                                       str(tmp_path / "out"), "--archive", str(archive), *options])
    assert result.exit_code == 0, result.output
    [line] = archive.read_text().splitlines()
    return result.output, json.loads(line)


def test_four_random_adapters_against_base_and_merged_models_fp32(tmp_path, tiny_chat_lm):
    output, entry = bench(tmp_path, tiny_chat_lm, "--dtype", "float32")
    for name in SYSTEMS:
        assert name in output
    assert "bar: batchgen-lora / base, output tok/s (generation)" in output
    assert "bar: batchgen-lora / merged-sequential, job tok/s" in output
    assert "agreement with the merged models: 8/8 adapter rows' greedy tokens equal: ok" in output

    assert entry["kind"] == "lora" and entry["workload"]["name"] == "lora" and entry["workload"]["rows"] == 8
    assert entry["workload"]["adapters"] == 4 and all(a["random"] and a["rank"] == 8
                                                      for a in entry["adapters"].values())
    assert isinstance(entry["cpu_flags"], list) and "rows" not in entry
    for name in SYSTEMS:
        f = entry["systems"][name]
        assert f["available"], f["reason"]
        assert f["dtype"] == "float32" and f["rows"] == 8 and f["output_tokens"] == 8 * 5
        assert f["output_tok_s"] > 0 and f["job_s"] == pytest.approx(f["load_s"] + f["wall_s"])
    jobs = entry["systems"]["merged-sequential"]["details"]["jobs"]
    assert [job["rows"] for job in jobs] == [2, 2, 2, 2]  # round-robin: one merged engine per adapter
    base, merged = entry["comparisons"]["base"], entry["comparisons"]["merged-sequential"]
    assert (base["bar"], merged["bar"]) == (0.8, 2.0)
    assert base["measure"] == "output_tok_s" and merged["measure"] == "job_tok_s"
    assert base["passes"] == (base["speedup"] >= 0.8)
    assert base["rows_as_base"] < 8  # the adapters change what the rows generate
    agreement = merged["agreement"]
    assert agreement["checked"] and agreement["ok"] and agreement["identical_rows"] == agreement["rows"] == 8


def test_given_adapters_and_bf16_where_agreement_is_not_checked(tmp_path, tiny_chat_lm):
    adapters = {name: write_adapter(tmp_path / name, tiny_chat_lm, rank=4, seed=seed)
                for seed, name in enumerate(("one", "two"), start=7)}
    output, entry = bench(tmp_path, tiny_chat_lm, "--dtype", "bfloat16", "--systems", "batchgen-lora,merged-sequential",
                          *[f"--lora={name}={path}" for name, path in adapters.items()])
    assert set(entry["systems"]) == {"batchgen-lora", "merged-sequential"} and entry["comparisons"].keys() == \
        {"merged-sequential"}
    assert entry["workload"]["adapters"] == 2 and not entry["adapters"]["one"]["random"]
    assert [job["rows"] for job in entry["systems"]["merged-sequential"]["details"]["jobs"]] == [4, 4]
    assert entry["comparisons"]["merged-sequential"]["agreement"]["checked"] is False
    assert "equal: not checked (fp32 only)" in output


def test_bad_options_are_refused(tmp_path, tiny_chat_lm):
    with pytest.raises(ValueError, match="--lora must be NAME=DIR"):
        parse_lora_options(("nodir",))
    with pytest.raises(ValueError, match="unknown hf-static for --workload lora"):
        run_lora_bench(LoraBenchConfig(model=str(tiny_chat_lm), systems=("hf-static",)))
    result = CliRunner().invoke(main, ["bench", "--workload", "lora", "--model", str(tiny_chat_lm), "--rows", "2",
                                       "--lora", f"wide={tmp_path / 'nowhere'}", "--archive",
                                       str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out")])
    assert result.exit_code != 0 and "lora adapter 'wide'" in result.output
