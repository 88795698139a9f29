"""A job never touches what is not its own (issue 22): another job's output (its temp directory's name, nesting
either way), an input reached through a symlink, special files (FIFOs, devices, huge files) given as the job file
or the schema file, YAML aliases that expand without bound, schemas nested too deep, a price that is not a
number, and a schema file's contents in an error message.

Jobs run through the CLI in-process with the engine replaced by the echo engine of test_bad_input (every test here
is about the job layer), or not at all where the job is refused before the model loads."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import yaml
from click.testing import CliRunner
from test_bad_input import (deadline, echo_job, error_line, loader, questions,  # noqa: F401 (fixtures)
                            run_in_process, write)

from batchgen.cli import main
from batchgen.job.plan import estimate as plan_module
from batchgen.job.output.output_dir import OutputDir, lock_output
from batchgen.job.output.parts import SUCCESS


def finished_output(tmp_path: Path, out: Path, rows: int = 20):
    """A finished job's output at `out` (its own input beside it)."""
    source = write(tmp_path / f"in-{out.name.strip('.')}.parquet", questions(rows))
    result = run_in_process(tmp_path, echo_job(source, out))
    assert result.exit_code == 0, result.stderr
    return result


def plan_in_process(tmp_path: Path, job: dict, *args: str):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return CliRunner().invoke(main, ["plan", str(path), *args])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- 1. another job's output ----------------------------------------------------------------------------------------

def test_a_directory_where_the_temp_directory_goes_is_never_written_or_removed(tmp_path, loader):
    """A finished output (or any user directory) sitting where output.path's temp directory goes: it was removed
    whole by the next run of that output, and its lock taken inside it."""
    other = tmp_path / "out" / "other"
    finished_output(tmp_path, other)
    victim = tmp_path / "out" / ".victimA.batchgen-tmp"
    other.rename(victim)  # as an older batchgen, which accepted that name, could have written it
    before = snapshot(victim)
    source = write(tmp_path / "in.parquet", questions(5))
    for run in (run_in_process, plan_in_process):
        line = error_line(run(tmp_path, echo_job(source, tmp_path / "out" / "victimA")), 2)
        assert f"{victim}, where batchgen keeps this output's temporary files, is not batchgen's" in line
    assert snapshot(victim) == before
    assert ds.dataset(victim, format="parquet").count_rows() == 20


def test_an_output_may_not_take_a_temp_directory_name(tmp_path, loader):
    source = write(tmp_path / "in.parquet", questions(5))
    line = error_line(run_in_process(tmp_path, echo_job(source, tmp_path / "out" / ".victimA.batchgen-tmp")), 2)
    assert "names ending in .batchgen-tmp are batchgen's temporary directories" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("state", ["finished", "running"])
def test_an_output_inside_another_jobs_output_is_refused(tmp_path, loader, state):
    base = tmp_path / "out" / "base"
    finished_output(tmp_path, base)
    if state == "running":  # committed parts, no _SUCCESS yet: a run killed half way
        (base / SUCCESS).unlink()
        for i, part in enumerate(sorted(base.glob("part-*.parquet"))):
            part.rename(base / f"run-{i:05d}.parquet")
    before = snapshot(base)
    source = write(tmp_path / "in.parquet", questions(5))
    for sub in ("sub", ".hidden/deeper"):
        for run in (run_in_process, plan_in_process):
            line = error_line(run(tmp_path, echo_job(source, base / sub)), 2)
            assert f"is inside {base}, another batchgen job's output" in line
    assert snapshot(base) == before


def test_an_output_holding_another_jobs_output_is_refused(tmp_path, loader):
    """A visible directory in an output is a foreign name already; a hidden one holding a job's output too."""
    base = tmp_path / "out" / "base"
    finished_output(tmp_path, base / ".inner")
    source = write(tmp_path / "in.parquet", questions(5))
    line = error_line(run_in_process(tmp_path, echo_job(source, base)), 2)
    assert f"holds {base / '.inner'}, another batchgen job's output" in line


def test_an_output_reached_through_a_symlink_shares_its_lock(tmp_path, loader):
    """Two names of one directory are one output: one temp directory, so one lock."""
    source = write(tmp_path / "in.parquet", questions(5))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    held = lock_output(OutputDir(tmp_path / "real" / "out"))
    try:
        line = error_line(run_in_process(tmp_path, echo_job(source, tmp_path / "link" / "out")), 75)
        assert "another batchgen run is writing" in line
    finally:
        os.close(held)
    assert not (tmp_path / ".link.batchgen-tmp").exists()


def test_a_run_resumes_over_a_temp_directory_an_older_batchgen_left(tmp_path, loader):
    """Unmarked, but holding only the lock and half-written files: an older batchgen's, taken over."""
    source = write(tmp_path / "in.parquet", questions(5))
    tmp = tmp_path / "out" / ".victim.batchgen-tmp"
    tmp.mkdir(parents=True)
    (tmp / "lock").write_bytes(b"")
    (tmp / "run-00003.parquet.inprogress").write_bytes(b"half")
    result = run_in_process(tmp_path, echo_job(source, tmp_path / "out" / "victim"))
    assert result.exit_code == 0, result.stderr
    assert ds.dataset(tmp_path / "out" / "victim", format="parquet").count_rows() == 5
    assert not tmp.exists()


# -- 2. the output inside the input through a symlink -----------------------------------------------------------------

@pytest.mark.parametrize("input_path, output_path", [("inpl", "inpdir/out"), ("inpdir", "inpl/out"),
                                                     ("inpl/**/*.parquet", "inpdir/out")])
def test_output_inside_the_input_through_a_symlink_is_refused(tmp_path, loader, input_path, output_path):
    (tmp_path / "inpdir").mkdir()
    write(tmp_path / "inpdir" / "one.parquet", questions(5))
    (tmp_path / "inpl").symlink_to(tmp_path / "inpdir")
    job = echo_job(tmp_path / input_path, tmp_path / output_path)
    for run in (run_in_process, plan_in_process):
        assert "is inside the input" in error_line(run(tmp_path, job), 2)
    assert not (tmp_path / "inpdir" / "out").exists()


def test_input_inside_the_output_is_refused(tmp_path, loader):
    """Reading an earlier job's part from where this job writes: --overwrite would delete the input."""
    out = tmp_path / "out"
    finished_output(tmp_path, out)
    job = echo_job(out / "part-00000.parquet", out)
    for run in (run_in_process, plan_in_process):
        assert "is inside output.path" in error_line(run(tmp_path, job), 2)
    assert (out / "part-00000.parquet").exists()


# -- 3 and 4. special files -----------------------------------------------------------------------------------------

def special_file(tmp_path: Path, kind: str) -> Path:
    """A path that is not a small regular file: a FIFO (reading it blocks), a device that never ends, a
    directory, a symlink to a device, or a (sparse) file over the size caps."""
    path = tmp_path / f"special-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as file:
            file.truncate(600 * 2**20)
    else:
        path.symlink_to({"zero": "/dev/zero", "urandom": "/dev/urandom", "link-to-zero": "/dev/zero"}[kind])
    return path


SPECIALS = {"fifo": "a FIFO (named pipe)", "zero": "a character device", "urandom": "a character device",
            "directory": "a directory", "link-to-zero": "a character device", "huge": "600.0 MiB, more than"}


@pytest.mark.parametrize("kind", sorted(SPECIALS))
@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_special_job_file_is_refused_without_reading_it(tmp_path, deadline, kind, command):
    path = special_file(tmp_path, kind)
    result = CliRunner().invoke(main, [command, str(path)])
    line = error_line(result, 2)
    assert line.startswith(f"batchgen: error: job file: {path} is {SPECIALS[kind]}"), line


@pytest.mark.parametrize("kind", sorted(SPECIALS))
def test_a_special_schema_file_is_refused_without_reading_it(tmp_path, loader, deadline, kind):
    source = write(tmp_path / "in.parquet", questions(3))
    path = special_file(tmp_path, kind)
    job = echo_job(source, tmp_path / "out", sampling={"json_schema_file": str(path)})
    for run in (run_in_process, plan_in_process):
        line = error_line(run(tmp_path, job), 2)
        assert f"sampling.json_schema_file: {path} is {SPECIALS[kind]}" in line, line
    assert loader.engines == []


def test_a_fifo_given_as_the_input_is_named(tmp_path, loader, deadline):
    os.mkfifo(tmp_path / "in.parquet")
    line = error_line(run_in_process(tmp_path, echo_job(tmp_path / "in.parquet", tmp_path / "out")), 2)
    assert f"input.path: {tmp_path / 'in.parquet'} is a FIFO (named pipe), not a regular file" in line


def test_sigterm_during_plan_ends_with_the_error_line(tmp_path, monkeypatch):
    """A plan killed while it works (or blocks) says so in its last line, as run does."""
    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the plan")
    monkeypatch.setattr(plan_module, "inspect_job", killed)
    source = write(tmp_path / "in.parquet", questions(3))
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # plan's own handler must take over
    try:
        result = plan_in_process(tmp_path, echo_job(source, tmp_path / "out"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert error_line(result, 130) == "batchgen: error: interrupted"


# -- 5 and 9. values that expand or nest without bound --------------------------------------------------------------

def alias_bomb(levels: int) -> str:
    """A YAML flow list of nine strings, then `levels - 1` lists of nine aliases to the one before."""
    text = '&a1 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'
    for level in range(2, levels + 1):
        text = f"&a{level} [{text}, " + ", ".join([f"*a{level - 1}"] * 8) + "]"
    return text


def test_a_yaml_alias_bomb_in_json_schema_is_refused_at_once(tmp_path, deadline):
    """419 bytes that expand to 9^7 items: `plan` took 2.6 GB and 19 s writing them as JSON."""
    job = tmp_path / "job.yaml"
    job.write_text(f"model: default\ninput: {{path: in.parquet}}\noutput: {{path: out}}\n"
                   f"sampling:\n  json_schema: {{type: string, enum: {alias_bomb(7)}}}\n")
    for command in ("run", "plan"):
        line = error_line(CliRunner().invoke(main, [command, str(job)]), 2)
        assert line.startswith("batchgen: error: sampling.json_schema: the job's values expand to more than "
                               "1,000,000 items"), line


@pytest.mark.parametrize("key", ["sampling.stop", "sampling.choice", "input.template", "engine.max_num_seqs",
                                 "output.keep_columns"])
@pytest.mark.parametrize("shape", ["bomb", "self"])
def test_aliases_that_expand_without_bound_are_refused_for_every_key(tmp_path, deadline, key, shape):
    section, name = key.split(".")
    value = alias_bomb(7) if shape == "bomb" else "&self [*self]"
    sections = {"input": "path: in.parquet", "output": "path: out"}
    sections[section] = (sections.get(section, "") + f"\n  {name}: {value}").strip("\n")
    text = "model: default\n" + "".join(f"{s}:\n  {body}\n" for s, body in sections.items())
    job = tmp_path / "job.yaml"
    job.write_text(text)
    line = error_line(CliRunner().invoke(main, ["plan", str(job)]), 2)
    assert line.startswith(f"batchgen: error: {key}: "), line
    assert ("expand to more than" if shape == "bomb" else "nested more than 64 levels deep") in line


def nested_schema(depth: int) -> str:
    """A schema of `depth` objects inside one another, as JSON text (built without recursion)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


@pytest.mark.parametrize("where", ["file", "inline JSON text", "inline YAML"])
def test_a_schema_nested_500_deep_is_a_job_error(tmp_path, loader, where):
    source = write(tmp_path / "in.parquet", questions(3))
    text = nested_schema(500)
    (tmp_path / "deep.json").write_text(text)
    sampling = {"file": {"json_schema_file": str(tmp_path / "deep.json")}, "inline JSON text": {"json_schema": text},
                "inline YAML": {"json_schema": "SCHEMA"}}[where]
    job = json.dumps(echo_job(source, tmp_path / "out", sampling=sampling))  # JSON is YAML
    path = tmp_path / "job.yaml"
    path.write_text(job.replace('"SCHEMA"', text))
    for command in ("run", "plan"):
        line = error_line(CliRunner().invoke(main, [command, str(path)]), 2)
        assert line.startswith("batchgen: error: sampling.json_schema") and "nested more than 64 levels deep" in line


# -- 10. the price --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("price", ["nan", "inf", "-inf", "0"])
@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_price_that_is_not_a_positive_finite_number_is_refused(tmp_path, loader, price, command):
    source = write(tmp_path / "in.parquet", questions(3))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(echo_job(source, tmp_path / "out")))
    result = CliRunner().invoke(main, [command, str(path), "--cost-per-hour", price])
    assert "--cost-per-hour" in error_line(result, 2)
    assert not (tmp_path / "out" / SUCCESS).exists()


def test_success_stays_strict_json_with_a_price(tmp_path, loader):
    source = write(tmp_path / "in.parquet", questions(3))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(echo_job(source, tmp_path / "out")))
    result = CliRunner().invoke(main, ["run", str(path), "--quiet", "--cost-per-hour", "2.5"])
    assert result.exit_code == 0, result.stderr
    summary = json.loads((tmp_path / "out" / SUCCESS).read_text(), parse_constant=lambda c: pytest.fail(c))
    assert summary["cost_per_hour"] == 2.5


# -- 11. a schema file's contents stay out of messages --------------------------------------------------------------

@pytest.mark.parametrize("content, path", [
    ({"type": "service_account", "project_id": "secret-project-1234", "private_key": "-----BEGIN KEY"}, "$.type"),
    ({"type": "object", "properties": {"token": {"type": "secret-token-value"}}}, "$.properties.token.type"),
    ({"type": "object", "required": "secret-field"}, "$.required"),
    ({"type": "object", "properties": {"a": "secret-string"}}, "$.properties.a"),
])
def test_an_error_about_a_schema_file_names_the_path_not_the_contents(tmp_path, loader, content, path):
    source = write(tmp_path / "in.parquet", questions(3))
    (tmp_path / "creds.json").write_text(json.dumps(content))
    job = echo_job(source, tmp_path / "out", sampling={"json_schema_file": str(tmp_path / "creds.json")})
    line = error_line(run_in_process(tmp_path, job), 2)
    assert f"sampling.json_schema_file: {tmp_path / 'creds.json'}: json_schema is not a JSON schema: at {path}" in line
    assert "secret" not in line and "service_account" not in line and "BEGIN" not in line, line


def test_xgrammars_own_message_about_a_schema_file_quotes_nothing(tmp_path, loader):
    """What xgrammar refuses beyond the structure check: its words, without the file's values (here it quotes the
    $ref it cannot resolve). An inline schema is the job's own text: its message keeps them."""
    source = write(tmp_path / "in.parquet", questions(3))
    schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/secret-token-value"}}}
    (tmp_path / "creds.json").write_text(json.dumps(schema))
    job = echo_job(source, tmp_path / "out", sampling={"json_schema_file": str(tmp_path / "creds.json")})
    line = error_line(run_in_process(tmp_path, job), 2)
    assert "json_schema does not compile: Cannot find field 'definitions' in …" in line and "secret" not in line, line
    inline = echo_job(source, tmp_path / "out", sampling={"json_schema": schema})
    assert "#/definitions/secret-token-value" in error_line(run_in_process(tmp_path, inline), 2)
