"""`batchgen plan` on a machine with no bench record: a probe on the job's own model and rows (job/plan/probe.py)
gives a time and a cost marked as a probe, within 2x of the sample job's real run; `--no-probe` gives the old "no
record" text. And a first run's summary shows its kernel build apart from the job's own throughput."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen.job import load_job
from batchgen.job.plan.estimate import make_plan
from batchgen.job.plan.probe import DECODE_STEPS, MAX_DECODE_STEPS, PREFILL_CHUNKS, _requests
from test_plan import plan_cli, tiny_chat_model, tiny_job, write_input, write_job  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]
GENERATION = re.compile(r"~([0-9,.]+) s of generation for all 30 rows \(\+ ([0-9.]+) s model load, "
                        r"\+ ([0-9.]+) s start-up: ~([0-9,.]+) s in all\)")


def cli(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    """batchgen from this tree, in the checkout (the sample job's input path is relative to it), on one thread: as
    under the suite's xdist workers, and what keeps a plan and a run comparable on a machine shared with other work,
    where a step's threads wait on each other whenever one is descheduled (stalls of seconds that no probe foresees:
    on this project's 2 cores, busy, two threads gave a probe of 10.1 s against a run of 31.2 s; one thread, 6.4 s
    against 5.6 s)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels")]), "OMP_NUM_THREADS": "1"}
    if cache is not None:
        env["BATCHGEN_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "batchgen", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def sample(tmp_path_factory, default_model_dir):
    """jobs/sample.yaml planned with no bench record (an archive that does not exist), then run with an empty kernel
    cache, so that the run compiles the C++ CPU kernels first, as a machine's first run does. The model is the
    default model's converted directory: the empty cache (BATCHGEN_CACHE_DIR) then forces the kernel build alone,
    not the GGUF conversion too."""
    root = tmp_path_factory.mktemp("probe")
    sets = ["--set", f"model={default_model_dir}", "--set", f"output.path={root / 'out'}"]
    planned = cli("plan", "jobs/sample.yaml", *sets, "--archive", str(root / "none.jsonl"), "--cost-per-hour", "3.6")
    started = time.perf_counter()
    ran = cli("run", "jobs/sample.yaml", *sets, cache=root / "cache")
    ran_s = time.perf_counter() - started
    assert ran.returncode == 0, ran.stderr[-3000:]
    return planned, ran, json.loads((root / "out" / "_SUCCESS").read_text()), ran_s


@pytest.mark.slow  # the sample job planned, then run with a kernel build: a minute or more
def test_plan_without_a_record_probes_for_time_and_cost(sample):
    planned, _, _, _ = sample
    assert planned.returncode == 0, planned.stderr[-3000:]
    out = planned.stdout
    assert "(weights loaded only for the time probe, nothing written)" in out.splitlines()[0]
    generation, load, startup, _ = (float(n.replace(",", "")) for n in GENERATION.search(out).groups())
    assert "ms per prompt token computed (a " in out and "decode steps at batch 30)" in out
    assert "a probe, not a bench record (none for this machine): the job's first rows, 30 at once, timed just now" \
        in out
    assert "rough: it takes every row to its max_tokens at a full batch" in out
    cost, seconds = (float(n.replace(",", "")) for n in re.search(
        r"cost +~\$([0-9.]+) at \$3\.60/h for ([0-9,.]+) s \(start-up and load included\)", out).groups())
    # each part is printed rounded to 0.1 s, so their sum may be off the printed whole by up to 0.15 s
    assert seconds == pytest.approx(generation + load + startup, abs=0.16)
    # $3.60/h is $0.001 a second; the cost is printed to 4 places and the seconds to 0.1 (5e-5 of a dollar each)
    assert cost == pytest.approx(seconds / 1000, rel=0.01, abs=1.1e-4)


@pytest.mark.slow  # the sample job planned, then run with a kernel build: a minute or more
def test_the_probe_is_within_2x_of_the_run(sample):
    """The plan's whole estimate (start-up, model load, generation) against the run command's measured wall time,
    both on this machine, less the run's one-off kernel build: the run compiled the C++ kernels first (an empty
    cache), the plan's probe had found them cached, and a machine pays that once, not per job."""
    planned, _, summary, ran_s = sample
    generation, load, startup, total = (float(n.replace(",", "")) for n in GENERATION.search(planned.stdout).groups())
    assert total == pytest.approx(generation + load + startup, abs=0.15)
    wall = ran_s - summary["kernel_build_s"]
    print(f"plan: {generation:.1f} s of generation + {load:.1f} s load + {startup:.1f} s start-up = {total:.1f} s; "
          f"run: {ran_s:.1f} s wall less a {summary['kernel_build_s']:.1f} s kernel build = {wall:.1f} s "
          f"({summary['generation_s']:.1f} s of generation)")
    assert 0.5 < total / wall < 2.0, (total, wall)


@pytest.mark.slow  # the sample job planned, then run with a kernel build: a minute or more
def test_a_first_run_shows_its_kernel_build_apart(sample):
    _, ran, summary, _ = sample
    build = summary["kernel_build_s"]
    assert build > 0  # the empty cache: the C++ CPU kernels were compiled in this run
    assert summary["generation_s"] + build < summary["wall_s"]
    assert summary["output_tokens_per_s"] == pytest.approx(summary["output_tokens"] / summary["generation_s"])
    assert re.search(rf"\n  kernel build +{build:.1f} s of the wall time compiling the C\+\+ CPU kernels", ran.stderr)
    assert f"tok/s over this run's {summary['generation_s']:,.1f} s of generation)" in ran.stderr


def test_no_probe_gives_the_old_text(tiny_job, tmp_path):
    archive = tmp_path / "empty.jsonl"
    archive.write_text("")
    result = plan_cli(tiny_job, "--archive", archive, "--cost-per-hour", "3.6", "--no-probe")
    assert result.exit_code == 0, result.output
    assert "(no weights loaded, nothing written)" in result.output.splitlines()[0]
    assert "time     no record for this model/device/dtype" in result.output
    assert "cost     no time estimate, so no cost" in result.output
    assert "a probe" not in result.output and "time probe" not in result.output


def test_the_probe_in_the_plan(tmp_path, default_model_dir):
    """make_plan's probe on the default model: the job's first rows at the planned batch (max_num_seqs 4 of the 6
    rows), their prompts cut to fit PREFILL_CHUNKS chunks of 32 tokens, the first chunk and the decode steps timed,
    the estimate from them."""
    prompts = [f"Question {i}: what does a {w} do in a kitchen, and how?" for i, w in enumerate(
        ["kettle", "toaster", "blender", "mixer", "grill", "juicer"])]
    job = write_job(tmp_path, "default", write_input(tmp_path / "in.parquet", prompts),
                    engine={"max_num_seqs": 4, "max_num_batched_tokens": 32, "kv_cache_memory": "16MiB"})
    plan = make_plan(load_job(job), archive=tmp_path / "none.jsonl", probe=True)
    found = plan.time.probe
    assert found is not None, plan.time.how
    assert found.batch == 4 and DECODE_STEPS <= found.decode_steps <= MAX_DECODE_STEPS
    assert found.cut_to == PREFILL_CHUNKS * 32 // 4
    assert found.chunk_tokens == 32 and found.per_prompt_token > 0 and found.per_output_token > 0
    computed = sum(plan.tokens.prompt) - plan.tokens.shared
    assert plan.time.seconds == pytest.approx(computed * found.per_prompt_token
                                              + plan.tokens.output_bound * found.per_output_token)
    assert plan.time.load_s == found.load_s > 0
    assert make_plan(load_job(job), archive=tmp_path / "none.jsonl").time.probe is None  # not asked for


def test_a_probe_the_engine_refuses_says_why(tiny_job, tmp_path):
    """The tiny model's vocabulary is smaller than its borrowed tokenizer's: the engine refuses every request (a run
    would make them error rows), and the plan's time line says so instead of failing."""
    plan = make_plan(load_job(tiny_job), archive=tmp_path / "none.jsonl", probe=True)
    assert plan.time.seconds is None and plan.time.probe is None and plan.time.probed and not plan.problems
    assert plan.time.how == (f"no bench archive at {tmp_path / 'none.jsonl'}; the time probe failed: the engine "
                             f"refused its requests: prompt token ids must be integers in [0, 384)")


def test_the_probe_cuts_long_prompts_to_a_few_chunks():
    prompts = [list(range(1000))] * 3
    chosen, cut_to = _requests(prompts, 8, 256, 4096)
    assert len(chosen) == 8 and cut_to == PREFILL_CHUNKS * 256 // 8 and {len(p) for p in chosen} == {cut_to}
    assert _requests([[1, 2, 3]], 2, 256, 4096) == ([[1, 2, 3], [1, 2, 3]], None)
