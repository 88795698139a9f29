"""The README's commands and job files run (issue 23): a README that drifts from the code fails here.

Every fenced `bash` and `yaml` block of README.md carries a marker on the line before its fence (an HTML comment,
invisible on GitHub):

- `<!-- runnable -->`: a `yaml` block is a complete job file, checked with `batchgen plan`; in a `bash` block each
  `batchgen ...` (or `python -m batchgen ...`) line runs as written and must exit 0, a `bash scripts/NAME.sh` line
  must name an existing script (it installs things, so it is not run), and a `pip install -e ".[EXTRAS]"` line must
  name extras that pyproject.toml defines.
- `<!-- runnable: plan -->`: as above, except that a `batchgen run ...` line, which would generate for too long
  here, is checked without generating: its options must parse (`batchgen run ... --help`) and `batchgen plan` must
  accept the same job with the same `--set`, `--executor` and `--overwrite` options.
- `<!-- not runnable: REASON -->`: a block this test cannot run (a vLLM virtualenv, a GPU, a cluster).

A `yaml` block whose first line is a comment naming a file (`# summarize.yaml: ...`) is written under that name, so
the commands after it can use it; when the repository has that file (`jobs/ticket_labels.yaml`), the block must hold
the same YAML. Everything runs in a scratch directory holding copies of `jobs/` and `data/samples/`, one command
after another in README order, in one child Python process that calls batchgen's command line (`batchgen.cli.main`)
once per command, so that torch and transformers are imported once: ~10-20 plan-sized commands and one short run.

This file is also that child process: `python tests/test_readme.py --run-steps STEPS.json`.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

CHECKED_LANGUAGES = {"bash", "sh", "shell", "console", "yaml", "yml"}
MARKER = re.compile(r"<!--\s*(runnable(?:\s*:\s*plan)?|not runnable\s*:\s*\S.*?)\s*-->")
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
NAMED_FILE = re.compile(r"^#\s*([\w./-]+\.ya?ml)\b")
# Removing markers (or whole runnable blocks) must fail this test, not shrink it: at least this many are run.
MIN_RUNNABLE_BLOCKS = 12
SEPARATOR = "=== readme step"
STEPS_TIMEOUT_S = 900


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: str | None  # "runnable", "runnable: plan", "not runnable: ..." or None

    @property
    def runnable(self) -> bool:
        return self.marker is not None and self.marker.startswith("runnable")

    @property
    def plan_only(self) -> bool:
        return self.marker is not None and re.sub(r"\s", "", self.marker) == "runnable:plan"

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def parse_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, each with the marker on the line right before its fence."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.group(1), opening.group(2).lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        before = lines[i - 1].strip() if i > 0 else ""
        marker = MARKER.fullmatch(before)
        blocks.append(Block(i + 1, language, "\n".join(body) + "\n", marker.group(1) if marker else None))
        i = j + 1
    return blocks


def logical_lines(script: str) -> list[str]:
    """A shell block's commands: continuation lines joined, blank and comment-only lines dropped."""
    commands, pending = [], ""
    for raw in script.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line and not line.startswith("#"):
            commands.append(line)
    if pending.strip():
        commands.append(pending.strip())
    return commands


def batchgen_args(argv: list[str]) -> list[str] | None:
    """The arguments after `batchgen` (or `python -m batchgen`), or None for another command."""
    if argv[:1] == ["batchgen"]:
        return argv[1:]
    if len(argv) >= 3 and re.fullmatch(r"python3?(\.\d+)?", argv[0]) and argv[1:3] == ["-m", "batchgen"]:
        return argv[3:]
    return None


def extras_defined() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: read the section's keys by hand
        section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
        return set(re.findall(r"^([\w-]+)\s*=", section, flags=re.M))
    return set(tomllib.loads(text)["project"].get("optional-dependencies", {}))


def run_as_plan(args: list[str]) -> list[str]:
    """`run JOB [options]` as the `plan` that checks the same job: --executor X becomes --set executor.kind=X, the
    options that only change what run prints are dropped; everything else is plan's too."""
    assert args[0] == "run"
    out, rest = ["plan"], iter(args[1:])
    for arg in rest:
        if arg in ("--quiet", "-q"):
            continue
        if arg == "--executor":
            out += ["--set", f"executor.kind={next(rest)}"]
        elif arg.startswith("--executor="):
            out += ["--set", f"executor.kind={arg.split('=', 1)[1]}"]
        else:
            out.append(arg)
    return out


@dataclass
class Step:
    argv: list[str]  # batchgen's arguments
    where: list[str]  # README lines it comes from
    expect: int = 0
    expect_text: str | None = None  # text its output must contain
    seconds: float | None = None
    code: int | str | None = None
    output: str = ""


@dataclass
class Plan:
    """What checking a README takes: files to write into the scratch directory, commands to run, and the
    problems found without running anything."""
    files: dict[str, str] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    runnable_blocks: int = 0

    def add(self, argv: list[str], where: str, **expected) -> None:
        if argv[:1] == ["plan"] and not expected:  # a plan reads only: one run of it answers every place it is in
            for step in self.steps:
                if step.argv == argv and step.expect == 0:
                    step.where.append(where)
                    return
        self.steps.append(Step(argv, [where], **expected))


def plan_readme(text: str) -> Plan:
    """Turn the README's marked blocks into files and commands; problems for unmarked blocks and unknown lines."""
    import yaml

    plan = Plan()
    extras = extras_defined()
    canary: tuple[str, str] | None = None
    for block in parse_blocks(text):
        if block.language not in CHECKED_LANGUAGES:
            continue
        if block.marker is None:
            plan.problems.append(f"{block.where}: a ```{block.language} block without a marker: put <!-- runnable -->, "
                                 f"<!-- runnable: plan --> or <!-- not runnable: REASON --> on the line before it")
            continue
        if not block.runnable:
            continue
        plan.runnable_blocks += 1
        if block.language in ("yaml", "yml"):
            try:
                job = yaml.safe_load(block.text)
            except yaml.YAMLError as exc:
                plan.problems.append(f"{block.where}: the job file is not YAML: {exc}")
                continue
            if not isinstance(job, dict) or "input" not in job or "output" not in job:
                plan.problems.append(f"{block.where}: a runnable yaml block must be a complete job file "
                                     f"(with input and output)")
                continue
            out_path = str((job.get("output") or {}).get("path", ""))
            if Path(out_path).is_absolute():
                plan.problems.append(f"{block.where}: output.path {out_path} is absolute: the test runs in a "
                                     f"scratch directory")
            named = NAMED_FILE.match(block.text.lstrip())
            name = named.group(1) if named else f"readme-job-{block.line}.yaml"
            if (ROOT / name).is_file() and yaml.safe_load((ROOT / name).read_text()) != job:
                plan.problems.append(f"{block.where}: this block is {name}, but it differs from the repository's "
                                     f"{name}: copy the file into the README again")
            if not any(n.startswith("readme-canary") for n in plan.files):  # the first job, with a key mistyped
                plan.files["readme-canary.yaml"] = block.text + "\nnot_a_job_key: 1\n"
                canary = ("readme-canary.yaml", f"{block.where} (canary: a key added that is not a job key)")
            plan.files[name] = block.text
            plan.add(["plan", name], block.where)
            continue
        for line in logical_lines(block.text):
            try:
                argv = shlex.split(line, comments=True)
            except ValueError as exc:
                plan.problems.append(f"{block.where}: cannot split {line!r}: {exc}")
                continue
            if not argv:
                continue
            args = batchgen_args(argv)
            if args is not None:
                if block.plan_only and args[:1] == ["run"]:
                    plan.add([*args, "--help"], f"{block.where} (options of: {line})")
                    plan.add(run_as_plan(args), f"{block.where} (planned: {line})")
                else:
                    plan.add(args, f"{block.where} ({line})")
            elif argv[0] == "bash" and len(argv) >= 2 and argv[1].startswith("scripts/"):
                if not (ROOT / argv[1]).is_file():
                    plan.problems.append(f"{block.where}: {argv[1]} does not exist")
            elif argv[:3] == ["pip", "install", "-e"] and len(argv) == 4:
                spec = re.fullmatch(r"\.(?:\[([\w,\s-]*)\])?", argv[3])
                named_extras = {e.strip() for e in (spec.group(1) or "").split(",") if e.strip()} if spec else None
                if named_extras is None:
                    plan.problems.append(f"{block.where}: {line!r} does not install this checkout (pip install -e .)")
                elif named_extras - extras:
                    plan.problems.append(f"{block.where}: {line!r} names extras pyproject.toml does not define: "
                                         f"{sorted(named_extras - extras)} (defined: {sorted(extras)})")
            else:
                plan.problems.append(f"{block.where}: the test does not know how to run {line!r}; mark the block "
                                     f"<!-- not runnable: REASON --> or use batchgen, bash scripts/... or "
                                     f"pip install -e")
    # Canaries: a job file and a command line that are wrong must fail, or the harness proves nothing.
    if canary is not None:
        plan.add(["plan", canary[0]], canary[1], expect=2, expect_text="unknown key not_a_job_key")
    if plan.steps:
        plan.add(["run", "jobs/sample.yaml", "--no-such-option", "--help"], "canary: an unknown option of run",
                 expect=2, expect_text="No such option")
    return plan


def make_workspace(directory: Path, files: dict[str, str]) -> Path:
    """A scratch copy of what the README's commands read: jobs/, data/samples/ and the README's own job files."""
    shutil.copytree(ROOT / "jobs", directory / "jobs")
    shutil.copytree(ROOT / "data" / "samples", directory / "data" / "samples")  # copy2: the files keep their mtime
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return directory


def run_steps(steps: list[Step], workspace: Path) -> str:
    """Run the steps in one child process (this file as a script) in `workspace`; fill in each step's exit code,
    time and output. Returns the whole output."""
    spec = workspace / ".readme-steps.json"
    spec.write_text(json.dumps([step.argv for step in steps]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("BATCHGEN_DEBUG", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run-steps", str(spec)], cwd=workspace,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=STEPS_TIMEOUT_S)
    results = json.loads(spec.with_suffix(".results.json").read_text()) if spec.with_suffix(
        ".results.json").is_file() else []
    chunks = re.split(rf"^{re.escape(SEPARATOR)} (\d+) .*$", proc.stdout, flags=re.M)
    outputs = {int(chunks[k]): chunks[k + 1] for k in range(1, len(chunks) - 1, 2)}
    for i, step in enumerate(steps):
        if i < len(results):
            step.code, step.seconds = results[i]["code"], results[i]["seconds"]
        step.output = outputs.get(i, "")
    return proc.stdout


def failures(steps: list[Step]) -> list[str]:
    found = []
    for step in steps:
        ok = step.code == step.expect and (step.expect_text is None or step.expect_text in step.output)
        if not ok:
            tail = "\n    ".join(step.output.strip().splitlines()[-15:])
            found.append(f"{'; '.join(step.where)}: `batchgen {shlex.join(step.argv)}` exited {step.code}, expected "
                         f"{step.expect}" + (f" with {step.expect_text!r}" if step.expect_text else "")
                         + f"; its output ends:\n    {tail}")
    return found


def plan_labels(output: str) -> list[str]:
    """The section labels of a plan's output (job, input, prompts, ...): the first word of each unindented line."""
    return [line.split()[0] for line in output.splitlines()
            if line.strip() and not line[0].isspace() and not line.startswith(("batchgen", "$"))]


# -- the tests -----------------------------------------------------------------------------------------------------

def test_every_shell_and_yaml_block_is_marked_and_known():
    plan = plan_readme(README.read_text())
    assert not plan.problems, "\n".join(plan.problems)
    assert plan.runnable_blocks >= MIN_RUNNABLE_BLOCKS, \
        f"only {plan.runnable_blocks} runnable blocks in README.md (at least {MIN_RUNNABLE_BLOCKS} expected)"


@pytest.mark.slow
def test_the_marked_blocks_run(tmp_path):
    plan = plan_readme(README.read_text())
    assert not plan.problems, "\n".join(plan.problems)
    workspace = make_workspace(tmp_path, plan.files)
    started = time.monotonic()
    run_steps(plan.steps, workspace)
    took = time.monotonic() - started
    timing = ", ".join(f"{shlex.join(s.argv[:2])} {s.seconds:.1f}s" for s in plan.steps if s.seconds is not None)
    problems = failures(plan.steps)
    assert not problems, f"{len(problems)} README command(s) failed ({took:.0f} s in all):\n" + "\n".join(problems)
    print(f"{len(plan.steps)} README commands in {took:.0f} s: {timing}")

    # The README's example of a plan shows the sections the plan prints today, in its order.
    example = next((b.text for b in parse_blocks(README.read_text())
                    if b.language == "" and b.text.startswith("$ batchgen plan jobs/sample.yaml\n")), None)
    assert example is not None, "README.md lost its example output of `batchgen plan jobs/sample.yaml`"
    real = next(s for s in plan.steps if s.argv == ["plan", "jobs/sample.yaml"])
    assert plan_labels(example) == plan_labels(real.output), \
        f"the README's plan example has the sections {plan_labels(example)}; the plan prints {plan_labels(real.output)}"

    # A python block followed by "It prints `...`" reads what the commands before it wrote, and prints that line.
    text = README.read_text()
    examples = re.findall(r"```python\n([^`]*)```\n\nIt prints `([^`]*)`", text)
    assert examples, "README.md lost its python example that reads the embeddings"
    for code, printed in examples:
        proc = subprocess.run([sys.executable, "-c", code], cwd=workspace, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == printed, \
            f"the README's python block printed {proc.stdout.strip()!r} (said: {printed!r}); stderr: {proc.stderr}"


def test_a_broken_block_is_reported():
    """The harness itself, without running anything: an unmarked block, an unknown command, a missing script and
    unknown extras are problems; a job file becomes a plan step, and canaries (a job with a key that is not one, an
    option run does not have) must fail. That a broken job or command really fails its step is what the canaries of
    test_the_marked_blocks_run prove."""
    text = "\n".join([
        "```bash", "batchgen plan jobs/sample.yaml", "```",
        "<!-- runnable -->", "```bash", "make install", "bash scripts/no_such_script.sh", 'pip install -e ".[nope]"',
        "```",
        "<!-- runnable -->", "```yaml", "input: {path: data/samples/prompts.parquet}", "output: {path: out/x}",
        "sampling: {temprature: 0.5}", "```",
    ]) + "\n"
    plan = plan_readme(text)
    problems = "\n".join(plan.problems)
    assert "README.md:1: a ```bash block without a marker" in problems
    assert "does not know how to run 'make install'" in problems
    assert "scripts/no_such_script.sh does not exist" in problems
    assert "extras pyproject.toml does not define: ['nope']" in problems
    assert [(s.argv, s.expect) for s in plan.steps] == [
        (["plan", "readme-job-11.yaml"], 0), (["plan", "readme-canary.yaml"], 2),
        (["run", "jobs/sample.yaml", "--no-such-option", "--help"], 2)]
    assert plan.files["readme-canary.yaml"].endswith("not_a_job_key: 1\n")


def test_run_lines_become_plans_of_the_same_job():
    assert run_as_plan(["run", "j.yaml", "--executor", "ray", "--set", "a=1", "-q", "--overwrite"]) == \
        ["plan", "j.yaml", "--set", "executor.kind=ray", "--set", "a=1", "--overwrite"]
    assert run_as_plan(["run", "j.yaml", "--executor=local", "--quiet"]) == ["plan", "j.yaml", "--set",
                                                                           "executor.kind=local"]
    assert [" ".join(c.split()) for c in logical_lines("a \\\n  b  # c\n# d\n\ne\n")] == ["a b # c", "e"]
    assert batchgen_args(["python", "-m", "batchgen", "plan", "x"]) == ["plan", "x"]
    assert batchgen_args(["bash", "x"]) is None


# -- the child process ---------------------------------------------------------------------------------------------

def _run_steps_here(spec: Path) -> None:
    """Run each step's arguments through batchgen's command line in this process; record exit codes and times."""
    import traceback

    from batchgen.cli import main

    results = []
    for i, argv in enumerate(json.loads(spec.read_text())):
        print(f"{SEPARATOR} {i} : batchgen {shlex.join(argv)}", flush=True)
        started = time.monotonic()
        try:
            returned = main.main(args=argv, prog_name="batchgen")
            code: int | str = returned if isinstance(returned, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 -- recorded as this step's failure; the next steps still run
            traceback.print_exc()
            code = "exception"
        sys.stdout.flush()
        sys.stderr.flush()
        results.append({"code": code, "seconds": round(time.monotonic() - started, 2)})
        spec.with_suffix(".results.json").write_text(json.dumps(results))  # a step that hangs keeps the earlier ones


if __name__ == "__main__" and sys.argv[1:2] == ["--run-steps"]:
    _run_steps_here(Path(sys.argv[2]))
