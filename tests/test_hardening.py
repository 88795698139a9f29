"""Hardening (issue 9): every failure ends stderr with one `batchgen: error:` line and its exit code, a traceback
only with --debug; a changed input is never resumed; the output schema does not depend on how the input was
written; damaged or foreign output files, invalid models and impossible settings are job errors found before the
model loads; the too-long-prompt error names the limit it hit.

Earlier runs are stood in for by committing fake results through the runner's own PartWriter (as in
test_resume.py): what a resume checks is on disk, whoever generated the rows."""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from click.testing import CliRunner
from test_resume import commit_all_rows, fake_result, make_job, run_cli

from batchgen.cli import main
from batchgen.engine import Engine, EngineArgs
from batchgen.job import JobConfigError, load_job, prepare_job
from batchgen.job.prepare import check_input_unchanged, fingerprint_text
from batchgen.job.runner import execute_job
from batchgen.job.output.schema import output_schema
from batchgen.job.output.part_writer import PartWriter
from batchgen.job.output.parts import FINGERPRINT_KEY
from batchgen.models.loader import UnsupportedModelError, load_model

ERROR = "batchgen: error: "


def error_line(stderr: str) -> str:
    """The one `batchgen: error:` line, which must be stderr's last."""
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith(ERROR), stderr[-3000:]
    assert sum(line.startswith(ERROR) for line in lines) == 1, stderr[-3000:]
    return lines[-1]


def job_error(job: Path, *args: str) -> str:
    """Exit 2 with exactly one line (in process: these stop before the model loads)."""
    result = CliRunner().invoke(main, ["run", str(job), *args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    message = result.stderr.strip()
    assert message.startswith(ERROR) and "\n" not in message, message
    return message


def set_keys(job: Path, **sections) -> Path:
    raw = yaml.safe_load(job.read_text())
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    job.write_text(yaml.safe_dump(raw, sort_keys=False))
    return job


def rewrite_input(root: Path, prompts: list[str], prompt_type=pa.string(), qid_type=pa.string(),
                  **write_options) -> Path:
    path = root / "in.parquet"
    table = pa.table({"qid": pa.array([f"q{i:03d}" for i in range(len(prompts))], qid_type),
                      "prompt": pa.array(prompts, prompt_type)})
    pq.write_table(table, path, **write_options)
    return path


def commit_rows(job: Path, rows: list[int], keep=lambda row: ()) -> None:
    """What an earlier run committed: `rows` in this order, two per run part, with their kept values."""
    prepared = prepare_job(load_job(job))
    writer = PartWriter(prepared.out, prepared.schema, fingerprint_text(prepared.fingerprint), 2, 60.0, True)
    for row in rows:
        writer.add(row, f"q{row:03d}", keep(row), fake_result(row))
    writer.commit()
    prepared.release()


def part_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# -- every failure: one last line, exit code, traceback only with --debug --------------------------------------------

FAILING_LOAD = """
import sys
from batchgen.cli import main
from batchgen.job.executors import local

def load_engine(job):
    raise {exception}

local.load_engine = load_engine
main(sys.argv[1:])
"""


def run_failing(job: Path, exception: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real CLI in its own process, with the model load replaced by `exception`."""
    script = FAILING_LOAD.format(exception=exception)
    return subprocess.run([sys.executable, "-c", script, "run", str(job), "--quiet", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


# Each failure with debugging off, then on: by --debug for one, by BATCHGEN_DEBUG=1 for the other (one click option
# reads both, whatever failed).
@pytest.mark.parametrize("exception, code, fragment, debug_args, debug_env", [
    ('RuntimeError("device lost\\nsecond line")', 1, "runtime failure: RuntimeError: device lost (committed rows are "
                                                     "kept; re-run the same command to resume", ("--debug",), None),
    ("KeyboardInterrupt()", 130, "interrupted; finished rows are committed, re-run the same command to resume", (),
     {"BATCHGEN_DEBUG": "1"}),
], ids=["runtime-failure", "interrupt"])
def test_failures_print_no_traceback_without_debug(tmp_path, exception, code, fragment, debug_args, debug_env):
    job = make_job(tmp_path, 3)
    plain = run_failing(job, exception)
    assert plain.returncode == code, plain.stderr[-3000:]
    assert "Traceback" not in plain.stderr and "second line" not in plain.stderr
    assert fragment in error_line(plain.stderr)
    debug = run_failing(job, exception, *debug_args, env=debug_env)
    assert debug.returncode == code
    assert "Traceback (most recent call last)" in debug.stderr and "in load_engine" in debug.stderr
    assert fragment in error_line(debug.stderr)


def test_job_errors_show_their_traceback_only_with_debug(tmp_path):
    job = set_keys(make_job(tmp_path, 2), input={"prompt_column": "question"})
    assert "input.prompt_column: column 'question' not found" in job_error(job)
    result = CliRunner().invoke(main, ["run", str(job), "--debug"])
    assert result.exit_code == 2 and "Traceback (most recent call last)" in result.stderr
    assert "input.prompt_column: column 'question' not found" in error_line(result.stderr)


# -- item 3: a changed input is refused, naming the file and what changed --------------------------------------------

def test_input_rewritten_after_a_kill_is_not_resumed(tmp_path):
    job = make_job(tmp_path, 4)
    commit_all_rows(job, 2)  # what a killed run had committed
    out, path = tmp_path / "out", tmp_path / "in.parquet"
    before = part_bytes(out)
    rewrite_input(tmp_path, [f"Another question entirely, number {i}?" for i in range(4)])  # same row count
    proc = run_cli(job, "--quiet")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert f"holds rows of a different job (input file {path.resolve()} changed: " in line
    assert "bytes" in line and "modified" in line and "--overwrite" in line
    assert part_bytes(out) == before  # nothing touched


def test_input_identity_covers_mtime_and_footer(tmp_path):
    job = make_job(tmp_path, 4)
    path = tmp_path / "in.parquet"
    prompts = pq.read_table(path)["prompt"].to_pylist()
    plain = {"compression": "none", "use_dictionary": False}  # so that other text of the same length keeps the size
    rewrite_input(tmp_path, prompts, **plain)
    commit_all_rows(job, 2)
    original = path.stat()
    os.utime(path, ns=(original.st_atime_ns, original.st_mtime_ns + 10**9))  # touched: same bytes, later mtime
    line = job_error(job)
    assert "changed: modified " in line and "bytes" not in line and "footer" not in line
    # the same size and modification time, other content: the Parquet footer tells them apart
    rewrite_input(tmp_path, [text.replace("Why", "How") for text in prompts], **plain)
    assert path.stat().st_size == original.st_size
    os.utime(path, ns=(original.st_atime_ns, original.st_mtime_ns))
    assert job_error(job).endswith(f"input file {path.resolve()} changed: other Parquet footer (schema, row groups "
                                   f"or statistics)); re-run with --overwrite to start over, or choose another "
                                   f"output.path")


def test_input_rewritten_while_the_job_runs_gets_no_success(tmp_path):
    job = make_job(tmp_path, 3)
    commit_all_rows(job, 3)
    prepared = prepare_job(load_job(job))
    rewrite_input(tmp_path, [f"Changed {i}" for i in range(3)])
    with pytest.raises(JobConfigError, match=r"^input\.path: input file .* changed: .* while the job ran"):
        execute_job(prepared)
    assert not (tmp_path / "out" / "_SUCCESS").exists() and len(list((tmp_path / "out").iterdir())) == 2
    fresh = prepare_job(load_job(job, ["output.path=" + str(tmp_path / "other")]))
    check_input_unchanged(fresh)  # an unchanged input passes
    fresh.release()


# -- item 4: the output schema does not depend on the input's string / list widths -----------------------------------

def test_output_schema_uses_portable_types():
    schema = output_schema(pa.large_string(), [("tags", pa.large_list(pa.large_string())),
                                               ("cat", pa.dictionary(pa.int8(), pa.large_string())),
                                               ("raw", pa.large_binary()), ("n", pa.int32())])
    assert schema.field("id").type == pa.string()
    assert [schema.field(n).type for n in ("tags", "cat", "raw", "n")] == [
        pa.list_(pa.string()), pa.string(), pa.binary(), pa.int32()]


def test_polars_style_input_gives_string_output_columns(tmp_path):
    """An input written with large_string (as polars writes it) finishes with the same output schema."""
    job = set_keys(make_job(tmp_path, 3), output={"keep_columns": ["prompt"]})
    rewrite_input(tmp_path, ["a?", "b?", "c?"], prompt_type=pa.large_string(), qid_type=pa.large_string())
    commit_rows(job, [0, 1, 2], keep=lambda row: (f"{'abc'[row]}?",))
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert table.schema.field("id").type == pa.string() and table.schema.field("prompt").type == pa.string()


def test_nested_keep_column_before_the_row_column_finalizes_in_input_order(tmp_path):
    """The final rewrite finds each run part's row groups by the `_row` statistics; a struct keep column has two
    Parquet leaves, so `_row`'s Arrow field index is not its Parquet column index."""
    job = set_keys(make_job(tmp_path, 6), output={"keep_columns": ["meta"]})
    meta = [{"lang": "en", "score": 100 + row} for row in range(6)]
    table = pq.read_table(tmp_path / "in.parquet").append_column("meta", pa.array(meta))
    pq.write_table(table, tmp_path / "in.parquet")
    commit_rows(job, [5, 1, 3, 0, 2, 4], keep=lambda row: (meta[row],))
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.output
    final = pq.read_table(tmp_path / "out")
    assert final["id"].to_pylist() == [f"q{row:03d}" for row in range(6)] and final["meta"].to_pylist() == meta


def test_run_parts_of_another_schema_are_refused_before_the_run(tmp_path):
    """Run parts whose types differ from this job's (e.g. written before the types were made portable) would
    fail the final rewrite after every row was generated: they are refused at the start."""
    job = make_job(tmp_path, 4)
    prepared = prepare_job(load_job(job))
    text = fingerprint_text(prepared.fingerprint)
    wide = prepared.schema.set(0, pa.field("id", pa.large_string()))
    for schema, rows in [(prepared.schema, [0, 2]), (wide, [1, 3])]:  # each final part needs both run parts
        writer = PartWriter(prepared.out, schema, text, 2, 60.0, True)
        for row in rows:
            writer.add(row, f"q{row:03d}", (), fake_result(row))
    prepared.release()
    assert "holds run-00001.parquet with other columns or types than this job writes" in job_error(job)


# -- item 6 and 10 (b): an invalid model is a job error ----------------------------------------------------------------

_NOISE = random.Random(0)  # seeded: pytest-xdist's workers must collect the same parameters


@pytest.mark.parametrize("content, fragment", [
    (_NOISE.randbytes(4096), "is not a valid GGUF file (it does not start with the GGUF magic bytes)"),
    (b"GGUF" + _NOISE.randbytes(4092), "is not a valid GGUF file"),
    (b"GGUF" + struct.pack("<IQQ", 3, 10**6, 10**6) + _NOISE.randbytes(100), "more than its 124 bytes can hold"),
], ids=["noise", "magic-then-noise", "counts-too-large"])
def test_garbage_gguf_is_refused_before_loading(tmp_path, monkeypatch, content, fragment):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))  # were it converted: not in the user's cache
    (tmp_path / "model.gguf").write_bytes(content)
    job = set_keys(make_job(tmp_path, 2), model=str(tmp_path / "model.gguf"))
    assert fragment in job_error(job)


def test_gguf_that_cannot_be_converted_is_a_job_error(tmp_path, monkeypatch):
    """A header that passes the cheap check over bytes transformers cannot read: the conversion's failure."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BATCHGEN_NO_CPU_KERNELS", "1")  # else the empty cache builds the C++ kernels first (minutes)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + os.urandom(200))
    job = set_keys(make_job(tmp_path, 2), model=str(gguf))
    proc = run_cli(job, "--quiet")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"model: {gguf} is not a GGUF file transformers can convert" in error_line(proc.stderr)
    assert "Traceback" not in proc.stderr and "re-run" not in proc.stderr
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def mamba_directory(path: Path) -> Path:
    from transformers import MambaConfig

    MambaConfig(num_hidden_layers=1, hidden_size=32, architectures=["MambaForCausalLM"]).save_pretrained(path)
    return path


def test_unsupported_architecture_is_named_before_missing_weights(tmp_path):
    model_dir = mamba_directory(tmp_path / "mamba")
    job = set_keys(make_job(tmp_path, 2), model=str(model_dir))
    assert "model: unsupported model architecture 'MambaForCausalLM'" in job_error(job)
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM"):
        load_model(model_dir, torch.float32, "cpu")


def test_a_setting_the_native_model_lacks_takes_the_generic_path(tiny_llama_dir, tmp_path):
    """A Llama with YaRN RoPE scaling, which batchgen's Llama does not implement: transformers' code runs it."""
    model_dir = tmp_path / "yarn"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert type(load_model(model_dir, torch.float32, "cpu")).__name__ == "TransformersCausalLM"
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(model_dir, torch.float32, "cpu", model_impl="native")


# -- items 7 and 8: output directories that cannot be used ---------------------------------------------------------------

def test_output_whose_parent_is_a_file_is_a_job_error(tmp_path):
    (tmp_path / "file").write_text("x")
    job = set_keys(make_job(tmp_path, 2), output={"path": str(tmp_path / "file" / "out")})
    proc = run_cli(job)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert error_line(proc.stderr).startswith(f"{ERROR}output.path: cannot write {tmp_path / 'file' / 'out'}: "
                                              f"Not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a read-only directory")
def test_read_only_output_is_a_job_error(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out").chmod(0o555)
    try:
        job = make_job(tmp_path, 2)
        assert job_error(job) == f"{ERROR}output.path: cannot write {tmp_path / 'out'}: Permission denied"
    finally:
        (tmp_path / "out").chmod(0o755)


@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_damaged_run_part_is_named_with_the_way_out(tmp_path, damage):
    job = make_job(tmp_path, 4)
    commit_all_rows(job, 4)
    part = tmp_path / "out" / "run-00001.parquet"
    data = bytearray(part.read_bytes())
    if damage == "truncated":
        data = data[:len(data) // 2]
    else:  # the last byte of the text column's last page: its checksum no longer matches
        chunk = pq.ParquetFile(part).metadata.row_group(0).column(1)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        data[start + chunk.total_compressed_size - 1] ^= 0xFF
    part.write_bytes(bytes(data))
    line = job_error(job)
    assert line.startswith(f"{ERROR}output.path: {part} is damaged: ")
    assert line.endswith("delete that file and re-run the same command (its rows are generated again)")
    if damage == "truncated":  # its fingerprint is lost with the footer: not provably batchgen's, left to the user
        assert job_error(job, "--overwrite") == line and part.exists()
    part.unlink()
    prepared = prepare_job(load_job(job))
    prepared.release()
    assert list(prepared.done) == [1, 1, 0, 0]


# -- item 10 (c): only files carrying batchgen's fingerprint are batchgen's ------------------------------------------------

def test_overwrite_keeps_a_users_file_named_like_a_part(tmp_path):
    job = make_job(tmp_path, 2)
    commit_all_rows(job, 1)
    theirs = tmp_path / "out" / "part-00007.parquet"
    pq.write_table(pa.table({"mine": [1, 2, 3]}), theirs)
    assert "holds files batchgen did not write (part-00007.parquet)" in job_error(job, "--overwrite")
    assert pq.read_table(theirs)["mine"].to_pylist() == [1, 2, 3]
    theirs.unlink()
    (tmp_path / "out" / "_SUCCESS").write_text("")  # e.g. Spark's marker: not batchgen's summary
    assert "holds files batchgen did not write (_SUCCESS)" in job_error(job, "--overwrite")


def test_final_parts_carry_the_fingerprint_and_overwrite_removes_them(tmp_path):
    job = make_job(tmp_path, 3)
    commit_all_rows(job, 3)
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 2
    for part in parts:
        schema = pq.read_schema(part)
        assert json.loads(schema.metadata[FINGERPRINT_KEY])["files"][0]["rows"] == 3
        assert schema.names[:3] == ["id", "text", "finish_reason"] and "_row" not in schema.names
    prepare_job(load_job(job), overwrite=True).release()
    assert list(out.iterdir()) == []


# -- item 10 (d), (e): settings and columns that would fail after the model loads --------------------------------------

def test_kv_cache_larger_than_the_machine_is_a_job_error(tmp_path):
    job = set_keys(make_job(tmp_path, 2), engine={"kv_cache_memory": "1TiB"})
    line = job_error(job)
    assert line.startswith(f"{ERROR}engine.kv_cache_memory: '1TiB' (1,024.0 GiB) is more than ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("columns, keys, fragment", [
    ({"prompt": pa.array([1, 2])}, {}, "input.prompt_column: column 'prompt' is int64 in "),
    ({"prompt": pa.array(["a", "b"]), "sys": pa.array([1.5, 2.5])}, {"system_column": "sys"},
     "input.system_column: column 'sys' is double in "),
    ({"chat": pa.array([[{"role": "user", "text": "hi"}]] * 2)}, {"messages_column": "chat"},
     "input.messages_column: column 'chat' is list<element: struct<role: string, text: string>> in "),
    ({"chat": pa.array(["hi", "yo"])}, {"messages_column": "chat"}, "it must hold a list of structs"),
])
def test_prompt_columns_of_the_wrong_type_are_job_errors(tmp_path, columns, keys, fragment):
    job = make_job(tmp_path, 2)
    pq.write_table(pa.table({"qid": ["a", "b"], **columns}), tmp_path / "in.parquet")
    set_keys(job, input={"system_prompt": None, **keys})
    assert fragment in job_error(job)


@pytest.mark.parametrize("prompt", [pa.array(["a", "b"], pa.large_string()), pa.array([None, None], pa.null()),
                                    pa.array(["a", "b"]).dictionary_encode()])
def test_text_columns_of_any_encoding_pass(tmp_path, prompt):
    job = make_job(tmp_path, 2)
    pq.write_table(pa.table({"qid": ["a", "b"], "prompt": prompt}), tmp_path / "in.parquet")
    prepare_job(load_job(job)).release()


# -- item 10 (a): the too-long error says which limit -------------------------------------------------------------------

@pytest.mark.parametrize("settings, expected", [
    ({}, "the model's context window is 512 tokens"),
    ({"max_model_len": 64}, "engine.max_model_len is 64 tokens"),
    ({"kv_cache_memory": "64KiB"}, "the KV cache holds 128 tokens (engine.kv_cache_memory)"),
])
def test_context_limit_names_the_limit(tiny_llama_dir, settings, expected):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="float32",  # 512 B/token
                               **{"kv_cache_memory": "1MiB", **settings}))
    assert engine.context_limit == expected


# -- found by probing the public contract: job files, per-row columns, output paths, usage errors ----------------------

def plan_error(job: Path, *args: str) -> str:
    """`batchgen plan`: exit 2, the one error line last."""
    result = CliRunner().invoke(main, ["plan", str(job), *args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    return error_line(result.stderr)


@pytest.mark.parametrize("text, fragment", [
    (b"model: default\nmodel: other\n", "invalid YAML (line 2, column 1): key 'model' is given twice (lines 1 and 2)"),
    (b"input: {path: a.parquet, path: b.parquet}\n", "key 'path' is given twice"),
    (b"\xff\xfe model: default\n", "job file: {job}: not UTF-8 text (byte 0: b'\\xff')"),
])
def test_job_files_that_are_not_one_clean_mapping_are_job_errors(tmp_path, text, fragment):
    job = tmp_path / "job.yaml"
    job.write_bytes(text)
    fragment = fragment.format(job=job)
    assert fragment in job_error(job)
    assert fragment in plan_error(job)


@pytest.mark.parametrize("column, values, expected", [
    ("choice", ["", "yes,no"], "column 'choice' is string in "),  # once read as a list of characters
    ("max_tokens", ["8", "9"], "column 'max_tokens' is string in "),  # once an error on every row
    ("regex", [1, 2], "column 'regex' is int64 in "),
])
def test_per_row_sampling_columns_of_the_wrong_type_are_job_errors(tmp_path, column, values, expected):
    job = make_job(tmp_path, 2)
    pq.write_table(pa.table({"qid": ["a", "b"], "prompt": ["Yes or no?"] * 2, column: values}),
                   tmp_path / "in.parquet")
    for line in (job_error(job), plan_error(job)):
        assert expected in line and f"as a per-row sampling.{column} it must hold" in line
    assert not (tmp_path / "out").exists()


def test_per_row_sampling_columns_of_the_right_types_pass(tmp_path):
    job = make_job(tmp_path, 2)
    pq.write_table(pa.table({"qid": ["a", "b"], "prompt": ["Yes or no?"] * 2, "max_tokens": [4.0, None],
                             "temperature": pa.array([0, 1], pa.int32()), "choice": [["yes", "no"], []],
                             "regex": pa.array(["[a-z]+", None]).dictionary_encode()}), tmp_path / "in.parquet")
    prepare_job(load_job(job)).release()


@pytest.mark.parametrize("input_path, output_path", [("in", "in/out"), ("in", "in"), ("in/**/*.parquet", "in/out"),
                                                     ("in/*/*.parquet", "in/out")])
def test_output_inside_the_input_is_a_job_error(tmp_path, input_path, output_path):
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"qid": ["a"], "prompt": ["hi"]}), tmp_path / "in" / "a.parquet")
    job = set_keys(make_job(tmp_path, 1), input={"path": str(tmp_path / input_path)},
                   output={"path": str(tmp_path / output_path)})
    expected = f"{ERROR}output.path: {tmp_path / output_path} is inside the input ({tmp_path / input_path})"
    assert job_error(job).startswith(expected)
    assert plan_error(job).startswith(expected)
    assert job_error(job, "--overwrite").startswith(expected)
    assert (tmp_path / "in" / "a.parquet").exists()


@pytest.mark.parametrize("input_path", ["in", "in/*.parquet", "in/**/*.parquet"])
def test_output_beside_the_input_is_allowed(tmp_path, input_path):
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"qid": ["a"], "prompt": ["hi"]}), tmp_path / "in" / "a.parquet")
    job = set_keys(make_job(tmp_path, 1), input={"path": str(tmp_path / input_path)},
                   output={"path": str(tmp_path / "in-out")})
    prepare_job(load_job(job)).release()


def test_plan_finds_an_output_parent_that_is_a_file_as_run_does(tmp_path):
    (tmp_path / "file").write_text("x")
    job = set_keys(make_job(tmp_path, 2), output={"path": str(tmp_path / "file" / "out")})
    line = plan_error(job)
    assert line == job_error(job)
    assert line.startswith(f"{ERROR}output.path: cannot write {tmp_path / 'file' / 'out'}: Not a directory")


@pytest.mark.parametrize("args, fragment", [
    (["run", "job.yaml", "--bogus"], "No such option '--bogus'"),
    (["plan", "job.yaml", "--sample-rows", "0"], "Invalid value for '--sample-rows'"),
    (["run", "job.yaml", "--cost-per-hour", "abc"], "Invalid value for '--cost-per-hour'"),
    (["nosuch"], "No such command 'nosuch'"),
    ([], "no command given"),
])
def test_usage_errors_end_with_the_error_line(args, fragment):
    proc = subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert fragment in error_line(proc.stderr)
    assert "Traceback" not in proc.stderr


def test_plan_says_which_limit_a_too_long_prompt_hit_as_run_does(tmp_path):
    from batchgen.job.plan.estimate import make_plan

    job = make_job(tmp_path, 2, engine={"max_model_len": 24})
    made = make_plan(load_job(job), False, 10, None, tmp_path / "no-archive.jsonl")
    errors = [row.error for row in made.tokens.errors]
    assert errors and all(error.startswith("prompt is too long: ") and
                          error.endswith("tokens, and engine.max_model_len is 24 tokens (at least one must be left "
                                         "to generate)") for error in errors), errors


def test_a_glob_of_partition_directories_reads_their_files(tmp_path):
    for day, rows in (("2026-01-01", ["a", "b"]), ("2026-01-02", ["c"])):
        (tmp_path / "data" / f"date={day}").mkdir(parents=True)
        pq.write_table(pa.table({"qid": rows, "prompt": ["hi"] * len(rows)}),
                       tmp_path / "data" / f"date={day}" / "part-0.parquet")
    job = set_keys(make_job(tmp_path, 1), input={"path": str(tmp_path / "data" / "date=2026-*")})
    prepared = prepare_job(load_job(job))
    prepared.release()
    assert [p.parent.name for p in prepared.inputs.files] == ["date=2026-01-01", "date=2026-01-02"]
    assert prepared.inputs.total_rows == 3
    set_keys(job, output={"path": str(tmp_path / "data" / "date=2026-01-03")})  # matched by the glob itself
    assert "is inside the input" in job_error(job)
