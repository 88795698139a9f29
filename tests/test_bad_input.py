"""Bad input never becomes a traceback (issue 9). A `string` value that is not valid UTF-8, and a value that its
template field's format spec does not suit, fail their own row only; a template may only name columns (with an
optional format spec); a Parquet file whose data is corrupt is refused before the model loads (exit 2), or, if it
breaks during the run, fails the run (exit 1) with one line naming it and the committed rows kept; and random
corruption of an input file leads to one of those outcomes, never to a traceback or a wrong row.

Most runs go through the CLI in-process with the model load replaced by an echo engine (byte tokens; each
result's text is its prompt), so that a wrong row shows; the UTF-8 rows also run on the default model."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.request import Result
from batchgen.job.executors import local
from batchgen.job.config import parse_job
from batchgen.job.output.output_dir import OutputDir
from batchgen.job.input.files import inspect_input
from batchgen.job.input.source import read_source

REPO = Path(__file__).resolve().parents[1]
BAD = b"\xff\xfe not UTF-8"


def utf8_strings(values: list[bytes | None]) -> pa.Array:
    """A `string` array holding these bytes as they are, valid UTF-8 or not (pyarrow does not check)."""
    return pa.array(values, pa.binary()).cast(pa.string(), safe=False)


def write(path: Path, table: pa.Table, **options) -> Path:
    pq.write_table(table, path, write_page_checksum=True, **options)
    return path


def flip_inside_column(path: Path, column: str) -> None:
    """Flip one bit in the middle of `column`'s data in the first row group (the footer stays readable)."""
    meta = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == column)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + chunk.total_compressed_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


class ByteTokenizer:
    added_tokens_decoder: dict = {}

    def __call__(self, texts, add_special_tokens, split_special_tokens=False):
        return {"input_ids": [list(text.encode()) for text in texts]}


class EchoEngine:
    """Stands in for the engine (with what the runner reads of it, and a context of 4096 tokens): every request
    finishes at once, its text the prompt its byte tokens spell."""

    tokenizer = ByteTokenizer()
    max_model_len = 4096
    context_limit = "the model's context window is 4096 tokens"

    def __init__(self, args):
        self.args = args
        self.rows: list[int] = []

    def generate(self, requests, on_step=None):
        for request in requests:
            self.rows.append(request.request_id)
            now = time.time()
            yield Result(request_id=request.request_id, text=bytes(request.prompt_token_ids).decode(),
                         token_ids=[1], finish_reason="stop", error=None,
                         prompt_tokens=len(request.prompt_token_ids), output_tokens=1, cached_tokens=0,
                         num_preemptions=0, arrival_time=now, first_scheduled_time=now, first_token_time=now,
                         finish_time=now)

    def stats(self) -> dict:
        return {}


class Loader:
    """Replaces local.load_engine: runs `before` (if set), then hands out a new EchoEngine."""

    def __init__(self):
        self.engines: list[EchoEngine] = []
        self.before = None

    def __call__(self, job):
        if self.before:
            self.before()
        self.engines.append(EchoEngine(job.config.engine))
        return self.engines[-1]


@pytest.fixture
def loader(monkeypatch) -> Loader:
    loader = Loader()
    monkeypatch.setattr(local, "load_engine", loader)
    return loader


def echo_job(input_path: Path, out: Path, **sections) -> dict:
    job = {"model": "default",
           "input": {"path": str(input_path), "id_column": "key", "chat_template": False, "sort": "none"},
           "output": {"path": str(out), "keep_columns": ["src"]}}
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value}
    return job


def run_in_process(tmp_path: Path, job: dict):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return CliRunner().invoke(main, ["run", str(path), "--quiet"])


def run_process(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`batchgen run job.yaml` in a real process, on this checkout's code (the installed batchgen may be another
    copy)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "batchgen", "run", "job.yaml", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def error_line(result, code: int) -> str:
    """The one `batchgen: error:` line of a run that exited with `code`."""
    assert result.exit_code == code, (result.exit_code, result.stderr, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.startswith("batchgen: error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def output_rows(out: Path) -> list[dict]:
    return ds.dataset(out, format="parquet").to_table().to_pylist()


def questions(n: int, start: int = 0) -> pa.Table:
    ids = range(start, start + n)
    return pa.table({"key": [f"k{i}" for i in ids], "prompt": [f"Question {i}: what is {i} plus {i}?" for i in ids],
                     "src": [f"s{i}" for i in ids]})


# -- values that are not valid UTF-8 --------------------------------------------------------------------------------

def test_invalid_utf8_values_are_row_errors_on_the_default_model(tmp_path):
    """Each bad value sits in the same record batch as good rows; only its row fails."""
    prompts = [b"What is 2+2?", BAD, b"Name a fruit.", b"Name a city.", b"Name a tree.", b"Say hi."]
    table = pa.table({"key": utf8_strings([b"k0", b"k1", b"k2", BAD, b"k4", b"k5"]),
                      "prompt": utf8_strings(prompts),
                      "sys": utf8_strings([b"Be brief."] * 2 + [BAD] + [b"Be brief."] * 3),
                      "src": utf8_strings([b"s0", b"s1", b"s2", b"s3", BAD, b"s5"])})
    write(tmp_path / "in.parquet", table)
    job = {"model": "default", "input": {"path": str(tmp_path / "in.parquet"), "id_column": "key",
                                         "system_column": "sys"},
           "sampling": {"max_tokens": 4},
           "engine": {"max_num_seqs": 8, "kv_cache_memory": "64MiB", "max_model_len": 256},
           "output": {"path": str(tmp_path / "out"), "keep_columns": ["src"]}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = run_process(tmp_path, "--quiet")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    rows = output_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == ["k0", "k1", "k2", None, "k4", "k5"]
    assert [r["src"] for r in rows] == ["s0", "s1", "s2", "s3", None, "s5"]
    assert [r["error"] for r in rows] == [None, "prompt is not valid UTF-8 (column 'prompt')",
                                          "system prompt is not valid UTF-8 (column 'sys')",
                                          "id is not valid UTF-8 (column 'key')",
                                          "value is not valid UTF-8 (column 'src')", None]
    assert [r["finish_reason"] == "error" for r in rows] == [False, True, True, True, True, False]
    assert all(r["output_tokens"] > 0 and r["text"] for r in (rows[0], rows[5]))


@pytest.mark.parametrize("when", [
    pa.array([0, 2 ** 62, 10 ** 15], pa.int64()).cast(pa.timestamp("us")),  # the year 146138: no Python datetime
    pa.array([0, 1, 10 ** 18 + 7], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),  # nanoseconds
    pa.array([5, 10 ** 9 + 1, None], pa.duration("ns")),
])
def test_times_python_cannot_hold_are_copied_as_they_are(tmp_path, loader, when):
    write(tmp_path / "in.parquet", questions(3).append_column("when", when))
    result = run_in_process(tmp_path, echo_job(tmp_path / "in.parquet", tmp_path / "out",
                                               output={"keep_columns": ["src", "when"]}))
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    table = ds.dataset(tmp_path / "out", format="parquet").to_table()
    assert table["when"].type == when.type and table["when"].combine_chunks().equals(when)
    assert table["error"].to_pylist() == [None, None, None]
    assert table["text"].to_pylist() == [f"Question {i}: what is {i} plus {i}?" for i in range(3)]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from batchgen.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


def chat(contents: list[bytes]) -> pa.Array:
    messages = pa.StructArray.from_arrays([pa.array(["user"] * len(contents)), utf8_strings(contents)],
                                          names=["role", "content"])
    return pa.ListArray.from_arrays(pa.array(range(len(contents) + 1), pa.int32()), messages)


@pytest.mark.parametrize("columns, settings, error", [
    ({"q": utf8_strings([b"Why?", BAD, b"How?"]), "n": [1, 2, 3]}, {"template": "Q{n}: {q}"},
     "prompt is not valid UTF-8 (column 'q')"),
    ({"chat": chat([b"Why?", BAD, b"How?"])}, {"messages_column": "chat"}, "prompt is not valid UTF-8 (column 'chat')"),
])
def test_invalid_utf8_in_template_and_messages_columns(tmp_path, tokenizer, columns, settings, error):
    path = write(tmp_path / "in.parquet", pa.table(columns))
    config = parse_job({"input": {"path": str(path), "sort": "none", **settings}, "output": {"path": "out"}})
    rows = list(read_source(config, inspect_input(config), tokenizer, None))
    assert [r.error for r in rows] == [None, error, None]
    assert rows[0].token_ids and rows[2].token_ids and rows[1].token_ids is None


# -- templates ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, message", [
    ("Letter: {prompt[5]}", "input.template: {prompt[5]} is not allowed; a field is a column name with an optional "
                            "format spec, e.g. {text} or {score:.2f} (no indexing, attributes, conversions or "
                            "nested fields)"),
    ("{prompt.nonexistent}", "input.template: {prompt.nonexistent} is not allowed; a field is a column name"),
    ("{prompt!r}", "input.template: {prompt!r} is not allowed"),
    ("{prompt:>{n}}", "input.template: {prompt:>{n}} is not allowed"),
    ("{prompt:.2f}", "input.template: {prompt:.2f} does not suit column 'prompt' (string): Unknown format code 'f'"),
    ("{prompt} {n:d}", "input.template: {n:d} does not suit column 'n' (double): Unknown format code 'd'"),
])
def test_templates_name_columns_only_and_are_refused_before_the_model_loads(tmp_path, loader, template, message):
    table = questions(3).append_column("n", pa.array([1.5, 2.0, 3.0]))
    write(tmp_path / "in.parquet", table)
    result = run_in_process(tmp_path, echo_job(tmp_path / "in.parquet", tmp_path / "out", input={"template": template}))
    assert error_line(result, 2).startswith(f"batchgen: error: {message}")
    assert result.stderr.count("\n") == 1
    assert loader.engines == [] and not (tmp_path / "out").exists()


def test_a_value_its_format_spec_does_not_suit_is_a_row_error(tmp_path, loader):
    # (not a column named `n`: that is the per-row number of samples)
    table = questions(3).append_column("count", pa.array([65, 2 ** 40, 66]))
    write(tmp_path / "in.parquet", table)
    job = echo_job(tmp_path / "in.parquet", tmp_path / "out", input={"template": "{key} {count:c} {count:,}"})
    result = run_in_process(tmp_path, job)
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    rows = output_rows(tmp_path / "out")
    assert [r["text"] for r in rows] == ["k0 A 65", "", "k2 B 66"]
    assert [r["error"] for r in rows] == [None, "input.template: {count:c} cannot format this row's value of "
                                                "column 'count': %c arg not in range(0x110000)", None]


# -- corrupt files --------------------------------------------------------------------------------------------------

def test_a_corrupt_data_page_is_refused_before_the_model_loads(tmp_path):
    """A real process: exit 2 with one line naming the file; nothing is written."""
    path = write(tmp_path / "in.parquet", questions(50))
    flip_inside_column(path, "prompt")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(echo_job(path, tmp_path / "out")))
    proc = run_process(tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"batchgen: error: input.path: {path} is corrupt: reading it failed after 0 rows")
    assert "checksum" in proc.stderr.lower() and proc.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda path: flip_inside_column(path, "prompt"), "is corrupt: reading it failed after 0 rows"),
    (lambda path: write(path, questions(12, start=10)), "is corrupt or was changed: it declared 10 rows but its "
                                                         "data holds more"),
])
def test_a_file_that_breaks_during_the_run_fails_it_and_keeps_committed_rows(tmp_path, loader, damage, message):
    (tmp_path / "in").mkdir()
    first = write(tmp_path / "in" / "a.parquet", questions(10))
    second = write(tmp_path / "in" / "b.parquet", questions(10, start=10))
    intact, stat = second.read_bytes(), second.stat()
    loader.before = lambda: damage(second)  # after every check passed
    job = echo_job(tmp_path / "in", tmp_path / "out", input={"read_batch_rows": 4}, output={"rows_per_part": 3})
    line = error_line(run_in_process(tmp_path, job), 1)
    assert f"input.path: {second} {message}" in line and str(first) not in line
    done = OutputDir(tmp_path / "out").done_rows(20)
    assert all(done[:10])

    second.write_bytes(intact)
    os.utime(second, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the file as the run found it: it resumes
    loader.before = None
    result = run_in_process(tmp_path, job)
    assert result.exit_code == 0, result.stderr
    assert loader.engines[-1].rows == [row for row in range(20) if not done[row]]  # committed rows stay
    expected = questions(20).to_pylist()
    assert [(r["id"], r["text"], r["src"]) for r in output_rows(tmp_path / "out")] == \
        [(e["key"], e["prompt"], e["src"]) for e in expected]


@pytest.fixture(scope="module")
def intact_input(tmp_path_factory) -> tuple[bytes, dict]:
    """A file of 40 rows in 3 row groups of several pages, with page checksums; and each id's expected row."""
    table = questions(40)
    path = write(tmp_path_factory.mktemp("intact") / "in.parquet", table, row_group_size=16, data_page_size=256)
    expected = {row["key"]: (row["prompt"], row["src"]) for row in table.to_pylist()}
    return path.read_bytes(), expected


def corrupt(data: bytes, seed: int) -> bytes:
    """Truncated at a random length, or one to four random bits flipped."""
    rng = random.Random(seed)
    if rng.random() < 0.3:
        return data[:rng.randrange(len(data))]
    damaged = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
    return bytes(damaged)


@pytest.mark.parametrize("seed", range(50))
def test_random_corruption_never_gives_a_traceback_or_a_wrong_row(tmp_path, loader, intact_input, seed):
    data, expected = intact_input
    (tmp_path / "in.parquet").write_bytes(corrupt(data, seed))
    result = run_in_process(tmp_path, echo_job(tmp_path / "in.parquet", tmp_path / "out"))
    assert "Traceback" not in result.stderr
    if result.exit_code == 2:
        assert result.stderr.count("\n") == 1 and str(tmp_path / "in.parquet") in error_line(result, 2)
        assert loader.engines == []
        return
    if result.exit_code == 1:  # only for what the checks before the model loads cannot see
        error_line(result, 1)
        assert loader.engines
        rows = [row for part in OutputDir(tmp_path / "out").run_parts() for row in pq.read_table(part).to_pylist()]
    else:
        assert result.exit_code == 0 and result.stderr == "", (result.exit_code, result.stderr, result.exception)
        rows = output_rows(tmp_path / "out")
        assert len(rows) == len(expected)
    for row in rows:
        if row["finish_reason"] != "error":
            assert (row["text"], row["src"]) == expected[row["id"]]


# -- special files and expanding values (issue 22): the same property, for what the job names ---------------------

SPECIAL_KINDS = ("fifo", "dev-zero", "dev-urandom", "directory", "symlink-to-zero", "oversized", "socket")
ALIAS_SHAPES = ("bomb", "self", "deep")
VALUE_KEYS = ("sampling.stop", "sampling.json_schema", "sampling.choice", "input.template", "input.system_prompt",
              "engine.max_num_seqs", "output.keep_columns")


def make_special(path: Path, kind: str) -> None:
    """Something that is not a small regular file, at `path`."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "oversized":  # sparse: above every cap without taking the disk
        with open(path, "wb") as file:
            file.truncate(1 << 30)
    elif kind == "socket":
        import socket
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))  # closed at once: the socket file stays
        server.close()
    else:
        path.symlink_to("/dev/urandom" if kind == "dev-urandom" else "/dev/zero")


def expanding_value(shape: str, rng: random.Random) -> str:
    """YAML text of a value that is small as written and huge or endless once expanded."""
    if shape == "self":
        return "&loop [x, *loop]"
    if shape == "deep":
        depth = rng.randint(70, 400)
        return "[" * depth + "x" + "]" * depth
    levels = rng.randint(6, 9)
    text = "&l1 [" + ", ".join(["lol"] * 9) + "]"
    for level in range(2, levels + 1):
        text = f"&l{level} [{text}, " + ", ".join([f"*l{level - 1}"] * 8) + "]"
    return text


@pytest.fixture
def deadline():
    """A blocked read (a FIFO waits for a writer) fails the test instead of hanging the suite."""
    def expire(signum, frame):
        raise TimeoutError("still running after 30 s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("seed", range(40))
def test_special_files_and_expanding_values_are_job_errors_never_hangs(tmp_path, loader, deadline, seed):
    """Whichever file the job names is a FIFO, a device, a directory, a socket or huge, and whichever value is a
    YAML alias that expands without end or nests hundreds deep: exit 2 with one line naming it, at once, before
    the model loads and before anything is written."""
    rng = random.Random(seed)
    source = write(tmp_path / "in.parquet", questions(4))
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    target = rng.choice(["job file", "schema file", "input", "value"])
    if target == "value":
        key = rng.choice(VALUE_KEYS)
        section, name = key.split(".")
        raw = echo_job(source, out)
        raw.setdefault(section, {}).pop(name, None)
        rest = yaml.safe_dump({k: v for k, v in raw.items() if k != section}, default_flow_style=False)
        body = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in raw[section].items())  # JSON values are YAML
        job.write_text(f"{rest}{section}:\n{body}  {name}: {expanding_value(rng.choice(ALIAS_SHAPES), rng)}\n")
        expected = key
    else:
        special = tmp_path / "special.data"
        kind = rng.choice(SPECIAL_KINDS)
        make_special(special, kind)
        if target == "job file":
            job = special
            expected = f"job file: {special}"
        elif target == "schema file":
            job.write_text(yaml.safe_dump(echo_job(source, out, sampling={"json_schema_file": str(special)})))
            expected = f"sampling.json_schema_file: {special}"
        else:
            job.write_text(yaml.safe_dump(echo_job(special, out)))
            expected = "input.path: "  # a directory holding no Parquet file is an input too, an empty one
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    line = error_line(result, 2)
    assert expected in line and (target == "value" or str(tmp_path / "special.data") in line), (target, line)
    assert loader.engines == [] and not out.exists()
