"""batchgen as a user installs it: the wheel built from this checkout, installed into a fresh directory outside it,
runs `batchgen plan`, `run` and `report` on a small job from another directory with the checkout out of reach (not
on the import path, site's .pth files, the editable install's among them, not read; an audit hook fails the command
that opens, lists or runs anything under it, or runs git at all); the wheel holds every file of batchgen/ and
batchgen_kernels/; and no installed module climbs from its own file to the directories around it or names a
checkout's tests/, docs/, scripts/ or dev/ but for the known uses below, which read the current directory."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "batchgen", "kernels")  # what the build reads
PACKAGES = {"batchgen": ROOT / "batchgen", "batchgen_kernels": ROOT / "kernels" / "batchgen_kernels"}
CHECKOUT_NAMES = re.compile(r"^(?:\.\./)*(?:tests|docs|scripts|dev)/")
# The installed modules' strings that name a checkout's file, each read from the current directory, never from
# beside the package: (module, string prefix) -> why.
KNOWN_CHECKOUT_NAMES = {
    ("*", "docs/performance-archive.jsonl"): "the bench archive: `--archive`'s default, in the current directory",
    ("batchgen/bench/gpu/step_kernel_tests.py", "tests/"): "the GPU check's step 1, run only from a checkout's root",
}
# Run as the `-c` program: the audit hook, then the installed console script (or `-m MODULE`) with its arguments.
GUARD = r'''
import atexit, os, runpy, sys
checkout, target = os.environ.pop("BATCHGEN_TEST_CHECKOUT"), os.environ.pop("BATCHGEN_TEST_TARGET")
touched = []

def under(path, root):
    try:
        path = os.path.abspath(os.fsdecode(path))
    except TypeError:  # a file descriptor
        return False
    return path == root or path.startswith(root + os.sep)

def hook(event, args):
    if event in ("open", "os.listdir", "os.scandir", "os.chdir", "glob.glob") and args and under(args[0], checkout):
        touched.append(f"{event} {args[0]}")
    elif event == "subprocess.Popen":
        executable, argv, cwd, _ = args
        argv = [argv] if isinstance(argv, (str, bytes)) else list(argv or ())
        if os.path.basename(os.fsdecode(argv[0] if argv else executable)) == "git":
            touched.append(f"git run: {argv}")
        if (cwd and under(cwd, checkout)) or any(under(a, checkout) for a in argv if isinstance(a, (str, bytes))):
            touched.append(f"subprocess {argv} in {cwd}")

def verdict():
    module = sys.modules.get("batchgen")
    if module is not None and not under(module.__file__, target):
        touched.append(f"batchgen imported from {module.__file__}, not the installed copy")
    if touched:
        sys.stderr.write("CHECKOUT REACHED:\n" + "\n".join(touched[:20]) + "\n")
        sys.stderr.flush()
        os._exit(97)

atexit.register(verdict)
sys.addaudithook(hook)
if sys.argv[1] == "-m":
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
'''


def dependency_paths() -> list[str]:
    """Where the installed dependencies live (torch, transformers, the default model's wheel, ...), none of them in
    the checkout."""
    found = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        found.append(site.getusersitepackages())
    kept = []
    for path in found:
        if Path(path).is_dir() and path not in kept and not Path(path).resolve().is_relative_to(ROOT):
            kept.append(path)
    return kept


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout's sources (the build writes nothing into the checkout) and
    installed with --target into a fresh directory."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(base / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel, = (base / "dist").glob("batchgen-*.whl")
    target = base / "target"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def guarded(target: Path, cwd: Path, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`SCRIPT ARGS...` or `-m MODULE ARGS...` under the guard, from `cwd`, with only the install and the
    dependencies on the path (-S: no site, so no .pth file adds the checkout's editable install)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *dependency_paths()]),
           "BATCHGEN_TEST_CHECKOUT": str(ROOT), "BATCHGEN_TEST_TARGET": str(target.resolve()),
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("BATCHGEN_DEBUG", None)
    return subprocess.run([sys.executable, "-S", "-c", GUARD, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def batchgen(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The installed console script, as a user's shell runs it."""
    return guarded(target, cwd, str(target / "bin" / "batchgen"), *args)


def test_the_wheel_holds_every_file_of_both_packages(installed):
    for name, source in PACKAGES.items():
        want = {p.relative_to(source) for p in source.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
        have = {p.relative_to(installed / name) for p in (installed / name).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
        assert sorted(map(str, want - have)) == [], f"{name}: in the checkout, not in the wheel"


def test_plan_run_and_report_from_the_installed_wheel(installed, tmp_path):
    """A small job (3 rows, 4 tokens each, the default model) in a directory of its own: plan, run and report exit 0
    and write what they should, with the checkout never reached."""
    work = tmp_path / "job"
    work.mkdir()
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["Name a colour.", "Say hello.", "Count to three."]}),
                   work / "prompts.parquet")
    (work / "job.yaml").write_text(yaml.safe_dump({
        "model": "default", "dtype": "float32",
        "input": {"path": "prompts.parquet", "id_column": "id", "prompt_column": "prompt", "chat_template": True},
        "sampling": {"max_tokens": 4, "temperature": 0.0},
        "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_cache_memory": "32MiB",
                   "max_model_len": 256},
        "output": {"path": "out"}}, sort_keys=False))

    plan = batchgen(installed, work, "plan", "job.yaml")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "batchgen plan: job.yaml" in plan.stdout and "memory" in plan.stdout
    assert not (work / "out").exists()  # a plan writes nothing

    run = batchgen(installed, work, "run", "job.yaml", "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((work / "out" / "_SUCCESS").read_text())
    rows = pq.read_table(sorted((work / "out").glob("*.parquet"))).to_pylist()
    assert sorted(row["id"] for row in rows) == [1, 2, 3] and all(row["text"] for row in rows), rows

    report = batchgen(installed, work, "report", "out", "-o", "again.html")
    assert report.returncode == 0, report.stderr[-3000:]
    assert (work / "again.html").stat().st_size > 1000 and (work / "out" / "_report.html").is_file()


def test_the_gpu_check_and_the_bench_commit_from_the_installed_wheel(installed, tmp_path):
    """Away from a checkout the GPU check's step 1 (the checkout's tests) is skipped, saying so, and no commit is
    recorded: no git runs in the package's directory."""
    out = tmp_path / "check"
    done = guarded(installed, tmp_path, "-m", "batchgen.bench", "--gpu", "--dry-run", "--steps", "environment",
                   "kernel_tests", "--out-dir", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    environment = json.loads((out / "step0_environment.json").read_text())
    tests = json.loads((out / "step1_kernel_tests.json").read_text())
    assert environment["ok"] and environment["git_commit"] is None
    assert tests["ok"] and tests["tests"] == [] and "not run from a batchgen checkout" in tests["skipped"]
    assert "skip" in done.stdout
    probe = tmp_path / "commit.py"
    probe.write_text("from batchgen.bench.harness import git_commit\nassert git_commit() is None\n")
    commit = guarded(installed, tmp_path, str(probe))
    assert commit.returncode == 0, commit.stderr[-3000:]


def climbs_from_its_file(node: ast.AST) -> bool:
    """`Path(__file__).parents[...]`, `....parent.parent`, `os.path.dirname(os.path.dirname(__file__))`."""
    if isinstance(node, ast.Attribute) and "__file__" in ast.unparse(node.value):
        return node.attr == "parents" or (node.attr == "parent" and isinstance(node.value, ast.Attribute)
                                          and node.value.attr == "parent")
    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("dirname") and node.args:
        inner = node.args[0]
        return (isinstance(inner, ast.Call) and ast.unparse(inner.func).endswith("dirname")
                and "__file__" in ast.unparse(inner))
    return False


def docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def test_no_installed_module_reaches_for_a_checkout(installed):
    climbing, named = [], []
    for name in PACKAGES:
        for path in sorted((installed / name).rglob("*.py")):
            module = str(Path("batchgen" if name == "batchgen" else "kernels/batchgen_kernels")
                         / path.relative_to(installed / name))
            tree = ast.parse(path.read_text())
            skip = docstrings(tree)
            for node in ast.walk(tree):
                if climbs_from_its_file(node):
                    climbing.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
                if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
                        and CHECKOUT_NAMES.match(node.value)
                        and not any(where in ("*", module) and node.value.startswith(prefix)
                                    for where, prefix in KNOWN_CHECKOUT_NAMES)):
                    named.append(f"{module}:{node.lineno}: {node.value!r}")
    assert climbing == [], "a path found from the module's own file, above its package"
    assert named == [], "a checkout's file named, not in KNOWN_CHECKOUT_NAMES"
