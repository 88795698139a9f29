"""Hardening of what batchgen caches and reads from a model directory (issue 22, items 3, 7, 8), through the CLI:
a damaged cached kernel library is built again, never loaded (a truncated .so killed the run with SIGBUS); a damaged
cached GGUF conversion is converted again, and one that passes the check but cannot be loaded is named with the
advice to delete it; an unusable cache directory is a job error naming the setting; a FIFO or an oversized file in a
model directory is a job error, never a hang.

Every run gets its own BATCHGEN_CACHE_DIR; the default model's conversions in the user's cache (the
default_model_dir and default_int8_dir fixtures) are only read, as HF directories or as the source of the damaged
copies."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_hardening import error_line, set_keys
from test_resume import make_job

from batchgen_kernels import cpu_build

# No kernel build (minutes) in the runs that do not test it.
NO_KERNELS = {"BATCHGEN_NO_CPU_KERNELS": "1"}


def cli(command: str, job: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`batchgen plan|run JOB` in a subprocess, `env` added to ours (None: unset); a hang fails the test."""
    args = [sys.executable, "-m", "batchgen", command, str(job), *(["--quiet"] if command == "run" else [])]
    merged = dict(os.environ)
    for key, value in env.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=merged)
    except subprocess.TimeoutExpired:
        pytest.fail(f"batchgen {command} hung (killed after {timeout} s)")


def job_for(tmp_path: Path, model: str | Path, rows: int = 2) -> Path:
    return set_keys(make_job(tmp_path, rows, sampling={"max_tokens": 4}), model=str(model))


def assert_job_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    line = error_line(result.stderr)
    assert "runtime failure" not in line and all(fragment in line for fragment in fragments), line
    return line


def assert_complete(result: subprocess.CompletedProcess, out: Path, rows: int = 2) -> None:
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert json.loads((out / "_SUCCESS").read_text())["rows"] == rows


# ---------------------------------------------------------------------------------------- item 7: kernel cache

@pytest.fixture(scope="module")
def built_library() -> Path:
    if os.environ.get("BATCHGEN_NO_CPU_KERNELS") or not cpu_build.load():
        pytest.skip("the C++ CPU kernels cannot be built here")
    return cpu_build.library_path(cpu_build._compiler())


def copying_compiler(tmp_path: Path, library: Path) -> Path:
    """A stand-in C++ compiler whose "build" copies an already built library: a rebuild costs no compile. Another
    library's build (the AMX one, on a CPU with AMX) fails, as a compiler without its flags would."""
    fake = tmp_path / "fake-c++"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "fake c++ 1.0"; exit 0; }\n'
                    'case "$*" in */amx/*) exit 1;; esac\n'
                    f'while [ $# -gt 1 ]; do [ "$1" = -o ] && exec cp "{library}" "$2"; shift; done\nexit 1\n')
    fake.chmod(0o755)
    return fake


def kernel_target(monkeypatch, cache: Path, compiler: Path) -> Path:
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(cache))
    monkeypatch.setenv("CXX", str(compiler))
    return cpu_build.library_path(cpu_build._compiler())


def test_a_truncated_cached_kernel_library_is_built_again_not_loaded(tmp_path, monkeypatch, built_library,
                                                                    default_model_dir):
    """Loading the truncated .so killed the run with SIGBUS (exit 135, empty stderr, a stale lock)."""
    compiler = copying_compiler(tmp_path, built_library)
    target = kernel_target(monkeypatch, tmp_path / "cache", compiler)
    target.parent.mkdir(parents=True)
    data = built_library.read_bytes()
    target.write_bytes(data)
    (target.parent / cpu_build.MANIFEST_NAME).write_text(json.dumps(cpu_build._digest(target)))  # as built
    target.write_bytes(data[:len(data) // 2])  # then cut short (a disk that failed; a copy interrupted)
    job = job_for(tmp_path, default_model_dir)
    result = cli("run", job, {"BATCHGEN_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(compiler),
                              "BATCHGEN_NO_CPU_KERNELS": None})
    assert_complete(result, tmp_path / "out")
    assert f"not loading the cached {target}" in result.stderr
    assert target.read_bytes() == data
    assert cpu_build.cached_problem(target) is None


def test_the_kernel_manifest_catches_a_damaged_or_unrecorded_library(tmp_path, monkeypatch, built_library):
    compiler = copying_compiler(tmp_path, built_library)
    target = kernel_target(monkeypatch, tmp_path / "cache", compiler)
    cpu_build.build(str(compiler), target)
    assert cpu_build.cached_problem(target) is None
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged at the same size
    target.write_bytes(bytes(data))
    assert "not what its manifest records" in cpu_build.cached_problem(target)
    target.with_name(cpu_build.MANIFEST_NAME).unlink()
    assert "no manifest" in cpu_build.cached_problem(target)


def test_an_unusable_kernel_cache_falls_back_to_torch_after_a_warning_naming_the_setting(tmp_path):
    """The kernels only speed a run up: a cache they cannot be built into is a warning, not a failed run."""
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("")
    code = ("import logging; logging.basicConfig()\n"
            "from batchgen_kernels import cpu_build\n"
            "print(cpu_build.load())\n")
    env = {**os.environ, "BATCHGEN_CACHE_DIR": str(not_a_dir)}
    env.pop("BATCHGEN_NO_CPU_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.split() == ["False"], result.stderr
    assert result.stderr.count("WARNING") == 1 and f"BATCHGEN_CACHE_DIR={not_a_dir}" in result.stderr


# --------------------------------------------------------------------------------- item 8: conversion cache

def damaged_entry(cache: Path, source: Path, with_manifest: bool, edit) -> Path:
    """A copy of the default model's cached conversion under `cache` (its weights linked, not copied), with or
    without the manifest this version writes, then damaged by `edit(entry)`."""
    entry = cache / "gguf" / source.name
    entry.mkdir(parents=True)
    for file in source.iterdir():
        if file.name == "model.safetensors":
            (entry / file.name).symlink_to(file)
        elif file.is_file() and file.name != "batchgen-manifest.json":
            shutil.copy(file, entry / file.name)
    if with_manifest:
        files = {file.name: file.stat().st_size for file in entry.iterdir()}
        (entry / "batchgen-manifest.json").write_text(json.dumps({"files": files}))
    edit(entry)
    return entry


def truncate_weights(entry: Path) -> None:
    weights = entry / "model.safetensors"
    source = weights.resolve()
    weights.unlink()
    with open(source, "rb") as src:
        weights.write_bytes(src.read(8 * 2**20))


def empty_tokenizer(entry: Path) -> None:
    (entry / "tokenizer.json").write_text("")


@pytest.mark.parametrize("command, with_manifest, edit", [("run", True, truncate_weights),
                                                          ("plan", False, empty_tokenizer)],
                         ids=["truncated-weights-run", "empty-tokenizer-plan"])
def test_a_damaged_cached_conversion_is_converted_again(tmp_path, default_int8_dir, command, with_manifest, edit):
    """Both ended in "runtime failure ... re-run the same command to resume", which never helps."""
    entry = damaged_entry(tmp_path / "cache", default_int8_dir, with_manifest, edit)
    result = cli(command, job_for(tmp_path, "default"), {"BATCHGEN_CACHE_DIR": str(tmp_path / "cache"), **NO_KERNELS},
                 timeout=600)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert f"the converted model {entry} in batchgen's cache is damaged" in result.stderr
    assert "Converting" not in result.stderr and "it/s" not in result.stderr  # no progress bars in a log
    if command == "run":
        assert_complete(result, tmp_path / "out")
    manifest = json.loads((entry / "batchgen-manifest.json").read_text())["files"]
    assert manifest["model.safetensors"] == (default_int8_dir / "model.safetensors").stat().st_size
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]  # no temp or damaged copies left


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_cached_conversion_damaged_at_the_same_size_is_named_with_the_advice_to_delete_it(tmp_path,
                                                                                           default_int8_dir,
                                                                                           command):
    """Its sizes and headers are right, so it is used, and fails to load: a job error naming the entry."""
    def garble(entry: Path) -> None:
        size = (entry / "tokenizer.json").stat().st_size
        (entry / "tokenizer.json").write_bytes(b"\xff" * size)

    entry = damaged_entry(tmp_path / "cache", default_int8_dir, True, garble)
    result = cli(command, job_for(tmp_path, "default"), {"BATCHGEN_CACHE_DIR": str(tmp_path / "cache"),
                                                         **NO_KERNELS})
    assert_job_error(result, "model: ", str(entry), "delete")


def test_an_unusable_cache_directory_is_a_job_error_naming_the_setting(tmp_path):
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("")
    for command in ("plan", "run"):
        result = cli(command, job_for(tmp_path, "default"), {"BATCHGEN_CACHE_DIR": str(not_a_dir), **NO_KERNELS})
        assert_job_error(result, "model: ", f"BATCHGEN_CACHE_DIR={not_a_dir}")
        assert not (tmp_path / "out").exists()  # found before anything is written to the output


def test_a_home_where_the_cache_cannot_be_created_is_a_job_error_naming_the_path(tmp_path):
    for command in ("plan", "run"):
        result = cli(command, job_for(tmp_path, "default"), {"HOME": "/proc", "BATCHGEN_CACHE_DIR": None,
                                                             **NO_KERNELS})
        assert_job_error(result, "model: ", "/proc/.cache/batchgen", "BATCHGEN_CACHE_DIR")
        assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------- item 3: a model directory's files

@pytest.fixture
def model_dir(tmp_path, tiny_llama_dir, default_model_dir) -> Path:
    """A tiny random-weight model with a real tokenizer (the default model's: nothing here gets to generate)."""
    path = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, path / name)
    return path


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def oversized(path: Path) -> None:
    with open(path, "wb") as file:
        file.truncate(17 * 2**20)  # sparse: over the 16 MiB cap without writing it


@pytest.mark.parametrize("name, make, command, fragment", [
    ("config.json", fifo, "plan", "FIFO"),
    ("tokenizer.json", fifo, "plan", "FIFO"),
    ("tokenizer.json", fifo, "run", "FIFO"),
    ("model.safetensors", fifo, "plan", "FIFO"),
    ("generation_config.json", fifo, "run", "FIFO"),
    ("tokenizer_config.json", oversized, "plan", "MiB"),
])
def test_a_model_file_that_is_not_a_regular_file_under_its_cap_is_a_job_error(tmp_path, model_dir, name, make,
                                                                              command, fragment):
    make(model_dir / name)
    result = cli(command, job_for(tmp_path, model_dir), {"BATCHGEN_CACHE_DIR": str(tmp_path / "cache"),
                                                         **NO_KERNELS}, timeout=120)
    assert_job_error(result, "model: ", str(model_dir / name), fragment)
