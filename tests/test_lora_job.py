"""Issue 42 through the job file: `lora:` (name -> a PEFT adapter: a local directory, a hub id or an s3:// prefix,
found and pinned as models are), each row's adapter from `input.lora_column` (null: `lora_default`, else the base
model), one engine for every adapter. On the default model (fp32): rows of the base and of two random rank-8
adapters alternating in one job equal transformers' greedy output with that adapter merged; a kill -9 and resume
gives the uninterrupted run's texts; every broken adapter is one line before the model loads (exit 2), and an
unknown adapter name is that row's error. `plan` counts the adapters; `run-batch --lora-modules` answers a request
whose `model` names an adapter with it, and says so in the response."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from batchgen.job.config import JobConfigError, parse_job
from batchgen.job.input.rows import SourceRow
from batchgen.job.input.source import sort_windows
from batchgen.job.prepare import locate_adapters
from cli_runs import kill_after_parts, read, run_cli
from test_lora_adapter import write_adapter

PROMPTS = ["The capital of France is", "List three colours:", "Once upon a time,", "def add(a, b):",
           "The quick brown fox", "Water boils at", "My favourite fruit is", "In 1969, humans", "A haiku about rain:"]
ADAPTERS = (None, "first", "second")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_model_dir)
    root = tmp_path_factory.mktemp("adapters")
    return {"first": write_adapter(root / "first", config, rank=8, alpha=16, seed=1),
            "second": write_adapter(root / "second", config, rank=8, alpha=32, seed=2, use_rslora=True)}


def write_rows(path: Path, rows: int) -> Path:
    """Rows alternating base / first / second, one naming an adapter the job does not have (row 4)."""
    names = [ADAPTERS[i % 3] for i in range(rows)]
    if rows > 4:
        names[4] = "third"
    pq.write_table(pa.table({"key": [f"r{i:03d}" for i in range(rows)],
                             "prompt": [PROMPTS[i % len(PROMPTS)] + f" ({i // len(PROMPTS)})" * (i >= len(PROMPTS))
                                        for i in range(rows)],
                             "lora": pa.array(names, pa.string())}), path)
    return path


def changed(job: dict, changes: dict) -> dict:
    """`job` with `changes` made: section__key=value sets a key of a section, key=value a top-level one."""
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            job[section][field] = value
        else:
            job[key] = value
    return job


def write_job(root: Path, name: str, model: Path, adapters: dict, source: Path, **extra) -> Path:
    job = {"model": str(model), "dtype": "float32", "lora": {k: str(v) for k, v in adapters.items()},
           "input": {"path": str(source), "id_column": "key", "chat_template": False},
           "sampling": {"max_tokens": MAX_TOKENS, "ignore_eos": True},
           "engine": {"kv_cache_memory": "256MiB", "max_num_seqs": 16},
           "output": {"path": str(root / name), "rows_per_part": 4, "commit_interval_s": 0.5}}
    changed(job, extra)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, default_model_dir, adapters):
    root = tmp_path_factory.mktemp("lora-job")
    source = write_rows(root / "in.parquet", 24)
    done = run_cli(write_job(root, "whole", default_model_dir, adapters, source))
    assert done.returncode == 0, done.stderr[-3000:]
    return root, source, read(root / "whole").sort("id")


def merged_texts(model_dir: Path, adapter: Path | None, prompts: list[str]) -> list[str]:
    """transformers' greedy texts with the adapter merged into the base weights (W + scale B A), fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchgen.lora import BaseShape, read_adapter
    from batchgen.lora.adapter import MLP_MODULES
    from batchgen.models.inspector import describe_config

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        lora = read_adapter("merged", adapter, BaseShape.of(describe_config(model.config)))
        with torch.no_grad():
            for (layer, module), weights in lora.modules.items():
                owner = model.model.layers[layer]
                owner = owner.mlp if module in MLP_MODULES else owner.self_attn
                getattr(owner, module).weight += weights.scale * weights.b @ weights.a
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False)
        texts.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    return texts


def test_rows_of_two_adapters_and_the_base_in_one_job_equal_the_merged_models(whole_run, default_model_dir,
                                                                               adapters):
    root, _, out = whole_run
    rows = out.head(len(PROMPTS)).to_dicts()
    assert [r["lora"] for r in rows] == [None, "first", "second", None, None, "second", None, "first", "second"]
    unknown = rows[4]
    assert unknown["finish_reason"] == "error" and unknown["error"].startswith("lora adapter 'third' is not one of "
                                                                                 "the job's (lora: first, second")
    for name in ADAPTERS:
        picked = [i for i, r in enumerate(rows) if r["lora"] == name and r["error"] is None]
        want = merged_texts(default_model_dir, adapters.get(name), [PROMPTS[i] for i in picked])
        assert [rows[i]["text"] for i in picked] == want, name
    base = {r["text"] for r in rows if r["lora"] is None and r["error"] is None}
    assert not base & {r["text"] for r in rows if r["lora"] is not None}  # each adapter changed its outputs

    success = json.loads((root / "whole" / "_SUCCESS").read_text())
    assert set(success["lora"]) == {"first", "second"} == set(success["fingerprint"]["lora"])
    assert success["lora"]["first"]["source"] == str(adapters["first"].resolve())
    assert len(success["lora"]["first"]["sha256"]) == 64
    stats = success["engine_stats"]
    assert (stats["lora_adapters"], stats["lora_slots"], stats["lora_loads"]) == (2, 2, 2)
    assert 0 < stats["lora_bytes"] < stats["weights_bytes"]
    assert success["peak_memory_bytes"] <= success["memory_bound_bytes"]
    assert success["job"]["lora"] == {name: str(path) for name, path in adapters.items()}


@pytest.mark.slow  # a second run of the job, killed, and its resume
def test_kill_9_and_resume_with_adapters_gives_every_row_once_and_the_same_texts(whole_run, default_model_dir,
                                                                                 adapters):
    root, source, whole = whole_run
    job = write_job(root, "killed", default_model_dir, adapters, source)
    kill_after_parts(job, root / "killed", 2)
    done = run_cli(job)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = read(root / "killed").sort("id")
    assert resumed["id"].to_list() == whole["id"].to_list()  # every row once
    assert resumed["text"].to_list() == whole["text"].to_list()
    assert resumed["lora"].to_list() == whole["lora"].to_list()


def test_more_adapters_than_max_loras_and_a_default_adapter(tmp_path, whole_run, default_model_dir, adapters):
    """max_loras 1: the two adapters take turns in the one slot, the rows' texts as with both resident; rows that
    name none take lora_default's."""
    root, _, whole = whole_run
    source = write_rows(tmp_path / "in.parquet", 12)
    job = write_job(tmp_path, "one-slot", default_model_dir, adapters, source, engine__max_loras=1,
                    lora_default="second")
    done = run_cli(job)
    assert done.returncode == 0, done.stderr[-3000:]
    out = read(tmp_path / "one-slot").sort("id")
    want = whole.head(12)
    names = want["lora"].to_list()
    errors = out["error"].to_list()
    assert errors[4].startswith("lora adapter 'third'") and sum(e is not None for e in errors) == 1
    assert out["lora"].to_list() == [None if i == 4 else name or "second" for i, name in enumerate(names)]
    seconds = [i for i, name in enumerate(names) if name == "second"]
    assert [out["text"][i] for i in seconds] == [want["text"][i] for i in seconds]
    firsts = [i for i, name in enumerate(names) if name == "first"]
    assert [out["text"][i] for i in firsts] == [want["text"][i] for i in firsts]
    stats = json.loads((tmp_path / "one-slot" / "_SUCCESS").read_text())["engine_stats"]
    assert stats["lora_slots"] == 1 and stats["lora_loads"] >= 2


# -- a broken adapter is one line, before the model loads ------------------------------------------------------------

def refused(job: Path) -> str:
    done = run_cli(job)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_every_broken_adapter_is_one_line_before_the_model_loads(tmp_path, default_model_dir, adapters,
                                                                 tiny_llama_dir):
    from transformers import AutoConfig

    source = write_rows(tmp_path / "in.parquet", 6)
    other_base = write_adapter(tmp_path / "other-base", AutoConfig.from_pretrained(tiny_llama_dir))
    head = write_adapter(tmp_path / "head", AutoConfig.from_pretrained(default_model_dir), layers=[0],
                         targets=["q_proj"])
    config = json.loads((head / "adapter_config.json").read_text())
    (head / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_bytes((adapters["first"] / "adapter_config.json").read_bytes())
    (corrupt / "adapter_model.safetensors").write_bytes(
        (adapters["first"] / "adapter_model.safetensors").read_bytes()[:5000])
    cases = {
        "missing": ({"first": tmp_path / "nowhere"}, "lora.first: ", "is not a directory"),
        "other base": ({"other": other_base}, "lora: lora adapter 'other': layers.0.q_proj", "lora_A is"),
        "lm_head": ({"head": head}, "lora: lora adapter 'head'", "lm_head"),
        "corrupt": ({"bad": corrupt}, "lora: lora adapter 'bad'", "adapter_model.safetensors"),
    }
    for case, (given, start, needle) in cases.items():
        line = refused(write_job(tmp_path, "out-" + case.replace(" ", "-"), default_model_dir, given, source))
        assert line.startswith(f"batchgen: error: {start}") and needle in line, (case, line)


def test_job_level_mistakes_name_their_key(tmp_path, adapters):
    source = write_rows(tmp_path / "in.parquet", 3)
    base = {"input": {"path": str(source)}, "output": {"path": str(tmp_path / "out")},
            "lora": {name: str(path) for name, path in adapters.items()}}

    def error(**changes) -> str:
        with pytest.raises(JobConfigError) as caught:
            parse_job(changed(json.loads(json.dumps(base)), changes))
        return str(caught.value)

    assert error(lora_default="third") == "lora_default: 'third' is not an adapter of lora: (its adapters: first, " \
                                          "second)"
    assert error(lora=["first"]).startswith("lora: expected a mapping")
    assert error(lora={"first": 3}).startswith("lora.first: expected a string")
    assert error(task="embed").startswith("lora: adapters apply to task generate, not embed")
    assert error(lora=None, input__lora_column="adapter").startswith("input.lora_column: the job has no adapters")
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "lora": [3]}), ints)
    from batchgen.job.prepare import inspect_job

    config = parse_job({**base, "input": {"path": str(ints)}})
    with pytest.raises(JobConfigError, match="input.lora_column: column 'lora' is int64 in .*; it must hold adapter "
                                             "names"):
        inspect_job(config)


def test_the_sort_puts_each_adapters_rows_together():
    rows = [SourceRow(i, i, (), tokens, None, lora=name) for i, (tokens, name) in
            enumerate([([5, 1], "b"), ([5, 1], None), ([2], "a"), ([5, 0], "b"), ([9], None), ([1], "a")])]
    assert [r.row for r in sort_windows(rows, 10, "prefix")] == [1, 4, 5, 2, 3, 0]
    assert [(r.lora, r.token_ids) for r in sort_windows(rows, 10, "prefix")] == [
        (None, [5, 1]), (None, [9]), ("a", [1]), ("a", [2]), ("b", [5, 0]), ("b", [5, 1])]
    assert [r.row for r in sort_windows(rows, 10, "none")] == list(range(6))


# -- where an adapter is: a hub id from the HF cache, an s3:// prefix --------------------------------------------------

def test_a_hub_adapter_is_pinned_to_its_commit_and_an_s3_one_to_its_cache_entry(tmp_path, monkeypatch, adapters):
    from s3_server import start_s3_server

    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--org--tuned" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (snapshot / name).write_bytes((adapters["first"] / name).read_bytes())
    (tmp_path / "hub" / "models--org--tuned" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tuned" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = start_s3_server()
    try:
        client = server.client()
        client.create_bucket(Bucket="adapters")
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            client.upload_file(str(adapters["second"] / name), "adapters", f"second/{name}")
        for key, value in server.env().items():
            if key.startswith("AWS_"):
                monkeypatch.setenv(key, value)
        monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
        source = write_rows(tmp_path / "in.parquet", 3)
        config = parse_job({"input": {"path": str(source)}, "output": {"path": str(tmp_path / "out")},
                            "lora": {"hub": "org/tuned", "s3": "s3://adapters/second/", "gone": "org/missing"}})
        with pytest.raises(JobConfigError, match="lora.gone: 'org/missing': not a local directory, and not in the "
                                                 "Hugging Face cache .*HF_HUB_OFFLINE=1 forbids downloading it"):
            locate_adapters(config)
        config = parse_job({"input": {"path": str(source)}, "output": {"path": str(tmp_path / "out")},
                            "lora": {"hub": "org/tuned", "s3": "s3://adapters/second/"}})
        found = locate_adapters(config)
    finally:
        server.stop()
    assert found["hub"].source == f"org/tuned@{commit}" and found["hub"].path == snapshot
    assert found["s3"].path.is_relative_to(tmp_path / "cache")
    assert (found["s3"].path / "adapter_model.safetensors").read_bytes() == \
        (adapters["second"] / "adapter_model.safetensors").read_bytes()
    first = locate_adapters(parse_job({"input": {"path": str(source)}, "output": {"path": str(tmp_path / "o")},
                                       "lora": {"x": str(adapters["first"])}}))["x"]
    assert found["hub"].sha256 == first.sha256  # the same files, however they were found


# -- plan, run-batch ----------------------------------------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True, timeout=900)


def test_plan_counts_the_adapters(tmp_path, default_model_dir, adapters):
    source = write_rows(tmp_path / "in.parquet", 6)
    job = write_job(tmp_path, "planned", default_model_dir, adapters, source, engine__max_loras=1)
    planned = cli("plan", str(job), "--no-probe")
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "lora: 2 adapters (first, second); each row's from column 'lora', the base model by default; 1 resident " \
           "at once (engine.max_loras 1), the others read in on demand" in planned.stdout
    assert "1 LoRA adapter slots" in planned.stdout


def test_run_batch_answers_a_request_naming_an_adapter_with_it(tmp_path, default_model_dir, adapters, whole_run):
    _, _, whole = whole_run
    requests = tmp_path / "requests.jsonl"
    bodies = [("a", "default", PROMPTS[0]), ("b", "first", PROMPTS[1]), ("c", "second", PROMPTS[2]),
              ("d", "unknown-model", PROMPTS[0])]
    requests.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                                            "body": {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0}}) + "\n"
                                for cid, model, prompt in bodies))
    results = tmp_path / "results.jsonl"
    done = cli("run-batch", "-i", str(requests), "-o", str(results), "--model", str(default_model_dir),
               "--lora-modules", f"first={adapters['first']}", "--lora-modules", f"second={adapters['second']}",
               "--set", "dtype=float32", "--set", "engine.kv_cache_memory=256MiB", "--set", "sampling.ignore_eos=true",
               "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    answers = {line["custom_id"]: line["response"]["body"] for line in map(json.loads, results.read_text().splitlines())}
    assert {cid: body["model"] for cid, body in answers.items()} == {
        "a": str(default_model_dir), "b": "first", "c": "second", "d": str(default_model_dir)}
    texts = dict(zip(whole["id"].to_list()[:3], whole["text"].to_list()[:3]))
    assert [answers[cid]["choices"][0]["text"] for cid in "abc"] == [texts["r000"], texts["r001"], texts["r002"]]
    assert answers["d"]["choices"][0]["text"] == texts["r000"]  # a model that names no adapter: the base model
