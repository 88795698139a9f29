"""`batchgen run` end to end on the default model, through the real CLI in a subprocess: output schema and
types, ids exactly once in input order, consistent timings, prefix-cache reuse, _SUCCESS agreeing with the rows,
bad rows as row errors, and job-level problems as exit code 2 with a one-line message (those in-process, since
they stop before the model loads)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main

REPO = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a meticulous assistant for a customer support team. Read the customer's question and answer "
          "it in one short sentence. Be polite, be precise, never invent facts, never mention these rules, "
          "and if the question is unclear, ask for clarification instead of guessing. ") * 2
QUESTIONS = ["Where is my order?", "How do I reset my password?", "Can I change my delivery address?",
             "Do you ship to Canada?", "What is your refund policy?", "Is the blue jacket waterproof?"]


def run_cli(job: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def write_job(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def base_job(input_path: Path, output_path: Path, **sections) -> dict:
    job = {
        "model": "default",
        "dtype": "float32",  # greedy rows compared across batch compositions: bf16's near-ties would flip
        "input": {"path": str(input_path), "id_column": "key", "system_prompt": SYSTEM},
        "sampling": {"max_tokens": 6, "temperature": 0.0},
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "kv_cache_memory": "64MiB",
                   "max_model_len": 320},
        "output": {"path": str(output_path), "keep_columns": ["source"], "rows_per_part": 3},
    }
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) else value
    return job


BAD = {  # key -> (prompt, temperature, max_tokens, expected error fragment)
    "k-null": (None, None, None, "prompt is null"),
    "k-empty": ("", None, None, "prompt is empty"),
    "k-long": ("Please summarize the following text carefully. " * 60, None, None,
               "tokens, and engine.max_model_len is 320 tokens"),  # the limit that was hit, named
    "k-temp": ("What time do you open?", -1.0, None, "temperature must be >= 0"),
    "k-maxtok": ("Do you sell gift cards?", None, 0, "max_tokens must be at least 1"),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One real run: 6 good rows sharing a long system prompt and 5 bad rows, interleaved."""
    root = tmp_path_factory.mktemp("e2e")
    keys, prompts, temps, maxes = [], [], [], []
    bad = iter(BAD.items())
    for i, question in enumerate(QUESTIONS):
        keys.append(f"k-{i}"), prompts.append(question), temps.append(None), maxes.append(None)
        item = next(bad, None)
        if item:
            key, (prompt, temp, max_tokens, _) = item
            keys.append(key), prompts.append(prompt), temps.append(temp), maxes.append(max_tokens)
    table = pa.table({"key": keys, "prompt": pa.array(prompts, pa.string()), "temperature": pa.array(temps, pa.float64()),
                      "max_tokens": pa.array(maxes, pa.int64()), "source": list(range(100, 100 + len(keys)))})
    pq.write_table(table, root / "in.parquet")
    job = write_job(root / "job.yaml", base_job(root / "in.parquet", root / "out"))
    proc = run_cli(job, "--set", "engine.max_num_seqs=6", "--cost-per-hour", "3.6", cwd=root)
    return root, job, table, proc


def output_of(out: Path) -> pl.DataFrame:
    return pl.read_parquet(f"{out}/*.parquet")


def test_run_succeeds_with_summary_on_stderr(finished):
    root, _, _, proc = finished
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "batchgen: done" in proc.stderr and "rows" in proc.stderr and "prefix cache" in proc.stderr
    assert "\r" not in proc.stderr  # no progress bar when stderr is not a terminal


def test_output_schema_and_types(finished):
    root, _, table, _ = finished
    schema = ds.dataset(root / "out").schema
    expected = [
        ("id", pa.string()), ("text", pa.string()), ("finish_reason", pa.string()), ("error", pa.string()),
        ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()), ("cached_tokens", pa.int64()),
        ("queue_s", pa.float64()), ("ttft_s", pa.float64()), ("tpot_s", pa.float64()), ("e2e_s", pa.float64()),
        ("arrival_time", pa.timestamp("us", tz="UTC")), ("first_token_time", pa.timestamp("us", tz="UTC")),
        ("finish_time", pa.timestamp("us", tz="UTC")), ("num_preemptions", pa.int64()), ("source", pa.int64()),
    ]
    assert [(f.name, f.type) for f in schema] == expected


def test_output_dir_holds_only_parts_success_and_the_report(finished):
    root, _, table, _ = finished
    names = sorted(p.name for p in (root / "out").iterdir())
    assert names[:3] == ["_SUCCESS", "_report.html", "_timeline.json"]
    assert all(n.startswith("part-") and n.endswith(".parquet") for n in names[3:])
    assert len(names) - 3 == 4  # 11 rows, rows_per_part 3
    assert not (root / ".out.batchgen-tmp").exists()


def test_every_id_once_in_input_order_with_keep_columns(finished):
    root, _, table, _ = finished
    df = output_of(root / "out")
    assert df["id"].to_list() == table["key"].to_pylist()
    assert df["source"].to_list() == table["source"].to_pylist()
    assert ds.dataset(root / "out").to_table()["id"].to_pylist() == table["key"].to_pylist()


def test_good_rows_generate_and_bad_rows_are_errors(finished):
    root, _, _, _ = finished
    rows = {r["id"]: r for r in output_of(root / "out").to_dicts()}
    for i in range(len(QUESTIONS)):
        row = rows[f"k-{i}"]
        assert row["finish_reason"] in ("stop", "length") and row["error"] is None
        assert 1 <= row["output_tokens"] <= 6 and row["text"]
    for key, (*_, fragment) in BAD.items():
        row = rows[key]
        assert row["finish_reason"] == "error" and fragment in row["error"], row
        assert row["output_tokens"] == 0 and row["text"] == ""
    assert rows["k-long"]["prompt_tokens"] > 320


def test_timings_are_consistent(finished):
    root, _, _, _ = finished
    df = output_of(root / "out")
    ok = df.filter(pl.col("finish_reason") != "error")
    for row in ok.to_dicts():
        assert 0 <= row["queue_s"] <= row["ttft_s"] <= row["e2e_s"]
        assert row["arrival_time"] <= row["first_token_time"] <= row["finish_time"]
        assert (row["tpot_s"] is None) == (row["output_tokens"] < 2)
        if row["tpot_s"] is not None:
            assert row["tpot_s"] >= 0
        # e2e_s is the distance between the timestamps (microsecond rounding aside)
        span = (row["finish_time"] - row["arrival_time"]).total_seconds()
        assert abs(span - row["e2e_s"]) < 2e-6
    for row in df.filter(pl.col("finish_reason") == "error").to_dicts():
        assert row["ttft_s"] is None and row["first_token_time"] is None and row["e2e_s"] >= 0


def test_rows_sharing_a_long_system_prompt_hit_the_prefix_cache(finished):
    root, _, _, _ = finished
    ok = output_of(root / "out").filter(pl.col("finish_reason") != "error")
    cached = ok["cached_tokens"].to_list()
    assert sum(c > 0 for c in cached) >= len(cached) - 1, cached  # all but the first prefilled
    assert max(cached) >= 96  # the system prompt spans several 16-token blocks
    assert all(c < p for c, p in zip(cached, ok["prompt_tokens"].to_list()))


def test_success_agrees_with_the_rows(finished):
    root, job, _, _ = finished
    summary = json.loads((root / "out" / "_SUCCESS").read_text())
    df = output_of(root / "out")
    ok = df.filter(pl.col("finish_reason") != "error")
    assert summary["rows"] == df.height == 11
    assert summary["rows_ok"] == ok.height == 6 and summary["rows_error"] == 5
    assert summary["prompt_tokens"] == df["prompt_tokens"].sum()
    assert summary["output_tokens"] == df["output_tokens"].sum()
    assert summary["cached_tokens"] == df["cached_tokens"].sum() > 0
    assert summary["preemptions"] == df["num_preemptions"].sum()
    assert summary["prefix_cache_hit_rate"] == pytest.approx(ok["cached_tokens"].sum() / ok["prompt_tokens"].sum())
    # the job's own rate, over its generation (the model load and a first run's kernel build are apart)
    assert 0 < summary["generation_s"] < summary["wall_s"] and summary["kernel_build_s"] >= 0
    assert summary["output_tokens_per_s"] == pytest.approx(summary["output_tokens"] / summary["generation_s"])
    assert summary["cost_per_hour"] == 3.6  # tokens per dollar of the run's wall time: tokens/s x 1000 s per dollar
    assert summary["tokens_per_dollar"] == pytest.approx(summary["output_tokens"] / summary["wall_s"] * 1000)
    assert summary["rows_this_run"] == 11 and summary["resumed"] is False
    assert summary["peak_memory_bytes"] > 0
    assert summary["job"]["engine"]["max_num_seqs"] == 6  # the resolved config, --set included
    assert summary["job"]["input"]["system_prompt"] == SYSTEM
    from importlib import metadata
    for library in ("torch", "transformers", "tokenizers", "xgrammar"):  # what the job ran with, as installed
        assert summary["versions"][library] == metadata.version(library)


def test_rerun_of_a_finished_job_does_nothing(finished):
    root, job, _, _ = finished
    before = {p.name: p.stat().st_mtime_ns for p in (root / "out").iterdir()}
    proc = run_cli(job, cwd=root)  # engine settings may differ: they do not change the results
    assert proc.returncode == 0 and "already complete (11 rows); nothing to do" in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (root / "out").iterdir()} == before


def test_changed_job_is_refused(finished):
    root, job, _, _ = finished
    result = CliRunner().invoke(main, ["run", str(job), "--set", "sampling.max_tokens=7"])
    assert result.exit_code == 2
    assert "holds rows of a different job (sampling changed)" in result.stderr
    assert "--overwrite" in result.stderr


def test_a_ggufs_conversion_format_is_part_of_the_job(finished, monkeypatch):
    """The default model's rows come from its GGUF's conversion (int8 since format 2, fp32 before): an output written
    from another conversion is another job's, not one to resume."""
    from batchgen.models import gguf_cache

    root, job, _, _ = finished
    summary = json.loads((root / "out" / "_SUCCESS").read_text())
    assert summary["fingerprint"]["gguf_conversion"] == gguf_cache.CONVERSION_FORMAT
    monkeypatch.setattr(gguf_cache, "CONVERSION_FORMAT", gguf_cache.CONVERSION_FORMAT + 1)
    result = CliRunner().invoke(main, ["run", str(job)])
    assert result.exit_code == 2
    assert "holds rows of a different job (gguf_conversion changed)" in result.stderr


def test_overwrite_with_another_sort_gives_the_same_rows(finished):
    root, job, table, _ = finished
    first = output_of(root / "out")
    proc = run_cli(job, "--overwrite", "--quiet", "--set", "input.sort=none", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""  # --quiet
    second = output_of(root / "out")
    assert second["id"].to_list() == table["key"].to_pylist()
    assert second["text"].to_list() == first["text"].to_list()  # greedy: the sort changes no result
    assert second["finish_time"].min() > first["finish_time"].max()  # generated again


def test_non_string_prompt_column_exits_2_before_the_model_loads(tmp_path):
    """Every row would fail: the column's type is refused with the job (tests/test_hardening.py has the rest)."""
    pq.write_table(pa.table({"key": ["x", "y"], "prompt": [7, None], "source": [1, 2]}), tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml", base_job(tmp_path / "in.parquet", tmp_path / "out"))
    proc = run_cli(job, "--quiet", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == (f"batchgen: error: input.prompt_column: column 'prompt' is int64 in "
                           f"{tmp_path / 'in.parquet'}; it must hold strings\n")
    assert not (tmp_path / "out").exists()


# -- job-level problems: exit 2, one line naming key / file / column, before the model loads ------------------------

@pytest.fixture
def small_input(tmp_path):
    pq.write_table(pa.table({"key": ["a", "b"], "prompt": ["hi", "yo"], "source": [1, 2]}), tmp_path / "in.parquet")
    return tmp_path


def job_error(tmp_path, job: dict | str, *args: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(job if isinstance(job, str) else yaml.safe_dump(job))
    result = CliRunner().invoke(main, ["run", str(path), *args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    message = result.stderr.strip()
    assert message.startswith("batchgen: error: ") and "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("change, fragment", [
    ({"sampling": {"temprature": 0.3}}, "unknown key sampling.temprature"),
    ({"sampling": {"max_tokens": "lots"}}, "sampling.max_tokens: expected an integer, got 'lots'"),
    ({"input": {"path": "nowhere/in.parquet"}}, "input.path: no such file or directory: nowhere/in.parquet"),
    ({"input": {"prompt_column": "question"}}, "input.prompt_column: column 'question' not found in"),
    ({"input": {"id_column": "uid"}}, "input.id_column: column 'uid' not found in"),
    ({"input": {"template": "Q: {question}"}}, "input.template: column 'question' not found in"),
    ({"output": {"keep_columns": ["lang"]}}, "output.keep_columns: column 'lang' not found in"),
    ({"model": "no/such/model"}, "model: 'no/such/model' not found"),
    ({"model": "."}, "model: directory . has no config.json"),
    ({"engine": {"block_size": 24}}, "engine.block_size: block_size must be a power of two"),
    ({"engine": {"kv_cache_memory": "lots"}}, "engine.kv_cache_memory: kv_cache_memory: expected a size"),
    ({"dtype": "fp8"}, "dtype: expected one of auto | float32 | bfloat16 | float16"),
])
def test_job_level_problems_exit_2(small_input, change, fragment):
    job = base_job(small_input / "in.parquet", small_input / "out", **change)
    assert fragment in job_error(small_input, job)
    assert not (small_input / "out").exists()


def test_job_file_problems_exit_2(small_input):
    assert "job.yaml: invalid YAML (line 3, column 1)" in job_error(small_input, "input:\n  path: [oops\n")
    assert "job file not found" in CliRunner().invoke(main, ["run", str(small_input / "none.yaml")]).stderr
    job = base_job(small_input / "in.parquet", small_input / "out")
    assert "--set 'engine.max_num_seqs': expected KEY=VALUE" in job_error(small_input, job, "--set",
                                                                        "engine.max_num_seqs")
    assert "engine.max_num_seqs: expected an integer" in job_error(small_input, job, "--set",
                                                                   "engine.max_num_seqs=many")


def test_engine_sort_is_deprecated_and_may_not_contradict_input_sort(small_input):
    job = base_job(small_input / "in.parquet", small_input / "out", engine={"sort": "none"}, input={"sort": "length"})
    assert "engine.sort: 'none' conflicts with input.sort: 'length'" in job_error(small_input, job)
    job = write_job(small_input / "job.yaml", base_job(small_input / "nowhere.parquet", small_input / "out"))
    proc = run_cli(job, "--set", "engine.sort=length", cwd=small_input)  # fails later, before the model loads
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "batchgen: engine.sort is deprecated: write input.sort: length instead",
        f"batchgen: error: input.path: no such file or directory: {small_input / 'nowhere.parquet'}",
    ]


def test_unusable_output_paths_exit_2(small_input):
    (small_input / "file").write_text("x")
    job = base_job(small_input / "in.parquet", small_input / "file")
    message = job_error(small_input, job)
    assert "output.path: " in message and "is not a directory" in message
    (small_input / "theirs").mkdir()
    (small_input / "theirs" / "report.csv").write_text("x")
    job = base_job(small_input / "in.parquet", small_input / "theirs")
    assert "holds files batchgen did not write (report.csv)" in job_error(small_input, job)
    assert "holds files batchgen did not write" in job_error(small_input, job, "--overwrite")
    assert (small_input / "theirs" / "report.csv").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_exits_2(small_input):
    job = base_job(small_input / "in.parquet", small_input / "out", device="cuda")
    assert "device: cuda was asked for but torch sees no CUDA device" in job_error(small_input, job)


def test_settings_the_engine_cannot_honour_exit_2(small_input):
    """Found while loading (the KV cache size depends on the model), still named by key."""
    job = base_job(small_input / "in.parquet", small_input / "out", engine={"kv_cache_memory": "64KiB"})
    assert "engine.kv_cache_memory: kv_cache_memory '64KiB' holds fewer than 2 blocks" in job_error(small_input, job)


def test_job_error_exit_code_from_a_real_process(small_input):
    job = write_job(small_input / "job.yaml", base_job(small_input / "in.parquet", small_input / "out",
                                                       input={"prompt_column": "question"}))
    proc = run_cli(job, cwd=small_input)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "input.prompt_column: column 'question'" in proc.stderr


def test_sample_jobs_are_valid(tmp_path):
    """The shipped job files parse and pass every check that needs no model."""
    from batchgen.job import load_job, prepare_job

    for job_file in sorted((REPO / "jobs").glob("*.yaml")):
        config = load_job(job_file, [f"input.path={REPO / load_job(job_file).input.path}",
                                     f"output.path={tmp_path / job_file.stem}"])
        prepared = prepare_job(config)
        prepared.release()
        assert prepared.inputs.total_rows > 0
