"""`batchgen plan`: the printed sections, the memory arithmetic on a tiny model (checked by hand), exit 2 with one
`batchgen: error:` line for the job-level problems run refuses, an output directory left exactly as it was, and
on the default model a peak-memory estimate within 10% of a real run's peak RSS and a prefix-cache share equal
to the run's."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from batchgen.cli import main
from batchgen.job import load_job
from batchgen.job.plan.estimate import make_plan
from batchgen.job.output.output_dir import OutputDir, lock_output

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("job", "input", "prompts", "tokens", "fit", "memory", "time", "cost", "output")
SHARED = "Classify the sentiment of this product review as positive, negative or neutral, in one word. "


@pytest.fixture(scope="module")
def tiny_chat_model(tiny_llama_dir, default_model_dir, tmp_path_factory) -> Path:
    """The tiny random Llama with the default model's tokenizer and chat template beside it."""
    model = tmp_path_factory.mktemp("tiny_chat")
    for source in (tiny_llama_dir, default_model_dir):
        for path in source.iterdir():
            if source == tiny_llama_dir or path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(path, model / path.name)
    return model


def write_input(path: Path, prompts: list[str]) -> Path:
    pq.write_table(pa.table({"id": list(range(len(prompts))), "prompt": prompts}), path)
    return path


def write_job(root: Path, model: Path | str, input_path: Path, **sections) -> Path:
    job = {"model": str(model), "dtype": "float32", "input": {"path": str(input_path), "id_column": "id"},
           "sampling": {"max_tokens": 8},
           "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "kv_cache_memory": "1MiB"},
           "output": {"path": str(root / "out")}}
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) else value
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def plan_cli(*args: str):
    return CliRunner().invoke(main, ["plan", *map(str, args)])


def tree(path: Path) -> list[tuple[str, int]]:
    """Every file under path's parent (the output and its temp sibling), with its size."""
    return sorted((str(p.relative_to(path.parent)), p.stat().st_size) for p in path.parent.rglob("*") if p.is_file())


# -- the tiny model: sections and arithmetic ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_job(tiny_chat_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plan_tiny")
    prompts = [SHARED + f"Review {i}: the kettle {'works' if i % 2 else 'leaks'} after {i} weeks." for i in range(6)]
    return write_job(root, tiny_chat_model, write_input(root / "in.parquet", prompts))


def test_plan_prints_every_section_and_writes_nothing(tiny_job):
    out = Path(yaml.safe_load(tiny_job.read_text())["output"]["path"])
    before = tree(out)
    result = plan_cli(tiny_job, "--cost-per-hour", "3.6")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines[1:] if not line.startswith(" ")] == list(SECTIONS)
    assert len(lines) <= 40  # one screen
    examples = [line for line in lines if line.startswith("  row ")]
    assert len(examples) == 3 and "leaks after 0 weeks." in examples[0] and "<|im_start|>assistant" in examples[0]
    assert "the first 6 of 6 rows (--sample-rows): 6 to generate, 0 row errors" in result.output
    assert "output tokens: at most 48 (n x max_tokens a row; a choice row: its candidates' tokens)" in result.output
    assert "no record for this model/device" in result.output  # no bench record names this model
    assert f"{out}: nothing yet: run starts with row 0" in result.output
    assert tree(out) == before and not out.exists()


def test_memory_arithmetic_by_hand(tiny_job, tiny_chat_model):
    tensors = load_file(tiny_chat_model / "model.safetensors")
    params = sum(t.numel() for t in tensors.values())
    plan = make_plan(load_job(tiny_job))
    assert plan.weights.parameters == params
    assert plan.memory_parts["weights"] == params * 4
    assert plan.memory_parts["mapped"] == 0  # the loader maps nothing
    # 2 x 2 layers x 2 kv heads x head_dim 16 x 4 bytes = 512 B/token; 1 MiB / (512 B x 16) = 128 blocks
    assert plan.kv_pool.bytes_per_token == 512 and plan.kv_pool.num_blocks == 128
    assert plan.kv_pool.reason == "kv_cache_memory '1MiB'"  # under 4 sequences x (512 tokens + 1 block)
    # resident: the rows' blocks (prompt + 8 max_tokens each, in 16-token blocks, less the shared ones), < 128
    blocks = sum(-(-n // 16) for n in plan.tokens.with_output) - plan.tokens.shared // 16
    assert plan.kv_blocks == blocks < 128 and plan.memory_parts["kv"] == blocks * 16 * 512
    assert plan.context == 512  # the model's 512 < the pool's 2,048 tokens
    longest = plan.tokens.prompt[-1]
    assert plan.step_tokens == 64  # the prompts hold more uncached tokens than one step
    assert plan.activation_parts == {
        "step": int(64 * (4 * 128 + 2 * 64) * 4 * 1.5),  # T x (4 x intermediate + 2 x hidden) fp32, x 1.5
        "logits": 4 * 384 * 4,  # 4 sequences x vocab, fp32
        "attention": int(2.5 * 4 * longest * longest * 4)}  # 4 heads x the longest prompt, in one chunk, squared
    assert longest < 64
    # the loader packs each matmul weight as it reads it: the plain ones are never held beside the packed ones
    matmuls = sum(t.numel() for name, t in tensors.items() if name.endswith(("_proj.weight", "lm_head.weight")))
    assert plan.memory_parts["released"] == -matmuls * 4
    assert plan.peak == sum(plan.memory_parts.values()) > plan.memory_parts["baseline"] > 100 * 2**20

    bf16 = make_plan(load_job(tiny_job, ["dtype=bfloat16", "engine.max_model_len=100"]))
    assert bf16.memory_parts["weights"] == params * 2
    assert bf16.memory_parts["mapped"] == 0  # every tensor converted: nothing keeps the file mapped
    # 1 MiB holds 256 blocks of bf16, but 4 sequences of the 100-token context use at most 4 x (7 + 1) blocks
    assert bf16.kv_pool.bytes_per_token == 256 and bf16.kv_pool.num_blocks == 32 and bf16.context == 100
    assert bf16.memory_parts["kv"] == min(32, blocks) * 16 * 256
    assert bf16.kv_pool.reason == "max_num_seqs 4 x (100-token context + 1 block), under kv_cache_memory '1MiB'"
    few_rows = make_plan(load_job(tiny_job, ["engine.max_num_seqs=256", "engine.max_model_len=100"]))
    assert few_rows.kv_pool.num_blocks == 6 * 8  # the job's 6 rows, not max_num_seqs 256


def test_shared_prefix_of_identical_prompts(tiny_chat_model, tmp_path, default_model_dir):
    from batchgen.models.loader import load_tokenizer

    prompt = "Translate to French, keeping the tone and the punctuation exactly as written: " * 3
    others = [f"Row {i} stands alone with words of its own, {i * 7} of them." for i in range(3)]
    job = write_job(tmp_path, tiny_chat_model, write_input(tmp_path / "in.parquet", [prompt] * 4 + others),
                    input={"chat_template": False})
    length = len(load_tokenizer(default_model_dir)(prompt)["input_ids"])
    plan = make_plan(load_job(job))
    # each repeat of the prompt finds its full blocks cached, except the one holding its last token
    assert plan.tokens.shared == 3 * ((length - 1) // 16) * 16
    assert len(plan.tokens.prompt) == 7 and plan.tokens.prompt.count(length) == 4


def test_time_and_cost_from_a_bench_archive(tiny_job, tiny_chat_model, tmp_path):
    from batchgen.machine import machine_info

    info = machine_info()
    machine = {"cpu": info["cpu"], "cores": info["cores"], "torch": "2.13.0+cpu"}

    def record(date, name, prompt, output, wall):
        system = {"available": True, "load_s": 1.0, "wall_s": wall, "prompt_tokens": prompt,
                  "output_tokens": output, "prefix_cache_hit_rate": 0.0}
        return {"date": date, "git_commit": "abcdef0123", "machine": machine, "workload": {"name": name, "model":
                str(tiny_chat_model)}, "config": {"engine_args": {"device": "auto"}}, "systems": {"batchgen": system}}

    archive = tmp_path / "archive.jsonl"
    archive.write_text("\n".join(json.dumps(r) for r in [
        record("2026-01-01T00:00", "labeling", 1000, 100, 2.0),
        record("2026-01-02T00:00", "generation", 100, 1000, 5.0),
        {**record("2026-01-03T00:00", "generation", 1, 1, 999.0), "machine": {**machine, "cores": 999}},
        {**record("2026-01-04T00:00", "generation", 1, 1, 999.0),  # another dtype than the job's (float32)
         "config": {"engine_args": {"device": "auto", "dtype": "bfloat16"}}},
        {**record("2026-01-06T00:00", "generation", 1, 1, 999.0),  # same CPU name, other instruction sets
         "machine": {**machine, "cpu_flags": {flag: not present for flag, present in info["cpu_flags"].items()}}},
        {"kind": "roofline", "date": "2026-01-05T00:00", "machine": machine, "decode": [], "prefill": []}]) + "\n")
    plan = make_plan(load_job(tiny_job), archive=archive)
    # 1000a + 100b = 2, 100a + 1000b = 5: a = 1.5152 ms per prompt token, b = 4.8485 ms per output token
    prompt = sum(plan.tokens.prompt) - plan.tokens.shared
    assert plan.time.seconds == pytest.approx(prompt * 1.51515e-3 + 48 * 4.84848e-3, rel=1e-4)
    assert plan.time.records == ("2026-01-01 00:00 labeling (abcdef0)", "2026-01-02 00:00 generation (abcdef0)")
    result = plan_cli(tiny_job, "--archive", archive, "--cost-per-hour", "3.6")
    assert result.exit_code == 0, result.output
    cost = float(re.search(r"~\$([0-9.]+) at \$3\.60/h", result.output).group(1))
    assert cost == pytest.approx((plan.time.seconds + 1.0) / 1000, abs=1e-4)  # $3.60/h = $0.001 per second


# -- job-level errors: exit 2, one line, nothing touched --------------------------------------------------------

def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.mark.parametrize("args, message", [
    (sets("sampling.temprature=0.5"), "unknown key sampling.temprature (did you mean sampling.temperature?)"),
    (sets("input.path=missing.parquet"), "input.path: no such file or directory: missing.parquet"),
    (sets("input.prompt_column=question"), "input.prompt_column: column 'question' not found in"),
    (sets("engine.max_num_seqs=0"), "engine.max_num_seqs: max_num_seqs must be a positive integer, got 0"),
    (sets("engine.kv_cache_memory=1KiB"), "engine.kv_cache_memory: kv_cache_memory '1KiB' holds fewer than 2 blocks"),
    (sets("engine.kv_cache_memory=64TiB"), "engine.kv_cache_memory: '64TiB' (65,536.0 GiB) is more than the memory"),
    (sets("model=models/none"), "model: 'models/none' not found"),
    # steps of up to a million 512-token prompts: terabytes of activations (the sample is not the whole input,
    # so the input's size does not bound the step)
    (sets("engine.max_num_batched_tokens=1000000000", "engine.max_num_seqs=1000000") + ["--sample-rows", "5"],
     "memory: the estimated peak ("),
])
def test_job_errors_exit_2(tiny_job, args, message):
    out = Path(yaml.safe_load(tiny_job.read_text())["output"]["path"])
    before = tree(out)
    result = plan_cli(tiny_job, *args)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("batchgen: error:")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert tree(out) == before


def test_memory_verdict_warns_over_80_percent_and_refuses_over_100():
    from batchgen.job.plan.estimate import memory_verdict

    assert memory_verdict(80 * 2**20, 100 * 2**20) == (None, None)
    assert memory_verdict(81 * 2**20, 100 * 2**20) == (None, "memory: the estimated peak (81 MiB) is 81% of the 100 "
                                                              "MiB available: little room for error or for other "
                                                              "processes")
    problem, warning = memory_verdict(101 * 2**20, 100 * 2**20)
    assert warning is None and problem.startswith("memory: the estimated peak (101 MiB) is 101% of the 100 MiB")


def test_output_refusals_exit_2_and_leave_it_alone(tiny_job, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not batchgen's")
    before = tree(out)
    result = plan_cli(tiny_job, "--set", f"output.path={out}")
    assert result.exit_code == 2
    assert "output   " + f"{out}: refused: output.path: {out} holds files batchgen did not write (notes.txt)" \
        in result.output
    assert result.output.splitlines()[-1].startswith(f"batchgen: error: output.path: {out} holds files batchgen")
    assert tree(out) == before

    locked = OutputDir(tmp_path / "locked")
    fd = lock_output(locked)  # as a running batchgen holds it
    try:
        before = tree(locked.path)
        result = plan_cli(tiny_job, "--set", f"output.path={locked.path}")
        assert result.exit_code == 2
        assert result.output.splitlines()[-1] == (f"batchgen: error: output.path: another batchgen run is writing "
                                                  f"{locked.path} (pid {os.getpid()})")
        assert tree(locked.path) == before
    finally:
        os.close(fd)


def test_partial_output_is_read_not_taken(tiny_job, tmp_path):
    """Two of six rows committed by the run's own writer, as a killed run leaves them; the plan counts them."""
    from batchgen.engine.request import Result
    from batchgen.job import prepare_job
    from batchgen.job.prepare import fingerprint_text
    from batchgen.job.output.part_writer import PartWriter

    config = load_job(tiny_job, [f"output.path={tmp_path / 'out'}"])
    job = prepare_job(config)
    writer = PartWriter(job.out, job.schema, fingerprint_text(job.fingerprint), 100, 60.0, sort_by_row=True)
    for row in (1, 4):
        writer.add(row, row, (), Result.for_error(row, "stand-in", 10, 0.0))
    writer.commit()
    job.release()
    before = tree(job.out.path)
    result = plan_cli(tiny_job, "--set", f"output.path={job.out.path}")
    assert result.exit_code == 0, result.output
    assert f"{job.out.path}: 2 of 6 rows committed: run resumes with the other 4" in result.output
    assert tree(job.out.path) == before


def test_model_without_chat_template_exits_2(tiny_llama_dir, default_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, model / name)
    job = write_job(tmp_path, model, write_input(tmp_path / "in.parquet", ["Hello there, how are you?"]))
    result = plan_cli(job)
    assert result.exit_code == 2
    assert result.output.strip() == (f"batchgen: error: input.chat_template: model {model} has no chat template; "
                                     f"set input.chat_template: false (or give one: input.chat_template: <a Jinja "
                                     f"template>)")
    assert plan_cli(job, "--set", "input.chat_template=false").exit_code == 0



def test_a_chat_template_the_job_gives(tiny_llama_dir, default_model_dir, tmp_path):
    """A model without one runs with the job's own Jinja template; the prompts are rendered through it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, model / name)
    job = write_job(tmp_path, model, write_input(tmp_path / "in.parquet", ["Hello there"]),
                    input={"chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}[answer]"})
    result = plan_cli(job)
    assert result.exit_code == 0, result.output
    assert "the job's chat template" in result.output and "[user] Hello there[answer]" in result.output
    assert plan_cli(job, "--set", "input.chat_template=").exit_code == 2

# -- the default model: the estimate against a real run --------------------------------------------------------

def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # this tree's batchgen and batchgen_kernels, whatever is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels")])}
    return subprocess.run([sys.executable, "-m", "batchgen", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, default_model_dir):
    """A real run of 8 chat rows sharing a long system prompt, and the plan made before it."""
    root = tmp_path_factory.mktemp("plan_default")
    prompts = [f"Question {i}: what does a {w} do?" for i, w in enumerate(
        ["kettle", "toaster", "blender", "mixer", "grill", "juicer", "fryer", "steamer"])]
    job = write_job(root, "default", write_input(root / "in.parquet", prompts),
                    input={"system_prompt": SHARED * 4}, sampling={"max_tokens": 4},
                    engine={"max_num_seqs": 8, "max_num_batched_tokens": 512, "kv_cache_memory": "64MiB"})
    planned = cli("plan", str(job), cwd=root)
    ran = cli("run", str(job), "-q", cwd=root)
    assert ran.returncode == 0, ran.stderr
    return root, job, planned, json.loads((root / "out" / "_SUCCESS").read_text())


def test_peak_estimate_within_10_percent_of_the_run(default_run):
    _, _, planned, summary = default_run
    assert planned.returncode == 0, planned.stderr
    estimate = float(re.search(r"peak RSS ~([0-9,]+) MiB", planned.stdout).group(1).replace(",", "")) * 2**20
    assert abs(estimate - summary["peak_memory_bytes"]) / summary["peak_memory_bytes"] < 0.10, \
        (estimate / 2**20, summary["peak_memory_bytes"] / 2**20)
    share = float(re.search(r"shared prefix: ([0-9.]+)%", planned.stdout).group(1)) / 100
    assert share == pytest.approx(summary["prefix_cache_hit_rate"], abs=0.01) and share > 0.5


def test_complete_and_changed_job_on_a_real_output(default_run):
    root, job, _, summary = default_run
    out = root / "out"
    before = tree(out)
    complete = plan_cli(job)
    assert complete.exit_code == 0, complete.output
    assert f"{out}: complete ({summary['rows']} rows, _SUCCESS): run does nothing" in complete.output
    changed = plan_cli(job, "--set", "sampling.max_tokens=5")
    assert changed.exit_code == 2
    assert changed.output.strip().splitlines()[-1] == (
        f"batchgen: error: output.path: {out} holds rows of a different job (sampling changed); re-run with "
        f"--overwrite to start over, or choose another output.path")
    overwrite = plan_cli(job, "--set", "sampling.max_tokens=5", "--overwrite")
    assert overwrite.exit_code == 0 and "--overwrite: run discards what this output holds" in overwrite.output
    assert tree(out) == before


def test_output_bound_counts_samples_and_choice_candidates(tiny_job, tiny_chat_model):
    """n samples generate n x max_tokens a row; a choice row computes its candidates' tokens and their ends."""
    from batchgen.models.loader import load_tokenizer

    plain = make_plan(load_job(tiny_job))
    samples = make_plan(load_job(tiny_job, ["sampling.n=4"]))
    assert samples.tokens.output_bound == 4 * plain.tokens.output_bound
    labels = ["alpha", "beta", "gamma"]
    choice = make_plan(load_job(tiny_job, [f"sampling.choice=[{', '.join(labels)}]"]))
    tokenizer = load_tokenizer(tiny_chat_model)
    per_row = sum(len(tokenizer.encode(label, add_special_tokens=False)) + 1 for label in labels)
    assert choice.tokens.output_bound == per_row * (len(choice.tokens.prompt))


def test_choice_rows_fit_by_their_longest_candidate_and_count_each_candidates_blocks(tiny_job, tiny_chat_model):
    """A choice row holds its prompt and one candidate at a time, not all of them: 200 labels fit a 512-token
    context. Its KV blocks: the PREFIX's (the prompt but its last token), then each candidate's own (a copy of the
    PREFIX's partial last block and the candidate's); its largest step, a chunk of scored positions' logits."""
    from batchgen.engine.model_runner import SCORE_CHUNK
    from batchgen.models.loader import load_tokenizer

    labels = [f"label number {i}" for i in range(200)]
    tokenizer = load_tokenizer(tiny_chat_model)
    lengths = [len(tokenizer.encode(label, add_special_tokens=False)) for label in labels]
    plan = make_plan(load_job(tiny_job, [f"sampling.choice=[{', '.join(labels)}]"]))
    assert plan.tokens.with_output[-1] > plan.context  # every label's tokens together would not fit
    assert plan.tokens.longest == sorted(p + max(lengths) for p in plan.tokens.prompt)
    assert plan.tokens.scored == plan.tokens.output_bound == len(plan.tokens.prompt) * (sum(lengths) + 200)
    blocks = sum(-(-(p - 1) // 16) + sum(-(-(p + n) // 16) - (p - 1) // 16 for n in lengths)
                 for p in plan.tokens.prompt)
    assert plan.tokens.blocks == blocks
    assert plan.kv_blocks == min(plan.kv_pool.num_blocks, blocks - plan.tokens.shared // 16)
    assert plan.activation_parts["logits"] == 2 * min(plan.step_tokens, SCORE_CHUNK) * 384 * 4
    result = plan_cli(tiny_job, "--set", f"sampling.choice=[{', '.join(labels)}]")
    assert result.exit_code == 0, result.output
    assert f"longest prompt + longest candidate {plan.tokens.longest[-1]:,} vs context 512 tokens" in result.output
    assert "does not fit" not in result.output
    too_long = plan_cli(tiny_job, "--set", f"sampling.choice=[{', '.join(labels)}]",
                        "--set", f"engine.max_model_len={plan.tokens.longest[-1] - 1}")
    assert "does not fit: such rows are errors" in too_long.output, too_long.output
