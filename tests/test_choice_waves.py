"""A `choice` of many labels runs its candidates in waves of at most max_num_seqs forks: the scheduler on its own
(no model), the engine on the default model (the same scores as all at once; abort frees everything), and a job
through `batchgen run` whose peak memory stays under the run's bound and within 10% of `batchgen plan`'s
estimate."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.kv_cache_manager import KVCacheManager
from batchgen.engine.request_group import RequestGroup
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import SequenceStatus
from batchgen.engine.step_output import StepOutput

from cli_runs import read, run_cli


def labels(count: int) -> list[str]:
    return [f"label {i:04d}" for i in range(1, count + 1)]


# -- the scheduler on its own ----------------------------------------------------------------------------------------

def choice_group(prompt_len: int, num_candidates: int, candidate_len: int = 3) -> RequestGroup:
    candidates = [[1000 + i] * candidate_len for i in range(num_candidates)]
    request = Request("c", list(range(prompt_len)), SamplingParams(choice=labels(num_candidates)))
    return RequestGroup(request, 0, candidates, lambda: None)


def step(sched: Scheduler) -> tuple[dict, list]:
    """One step with no model: every scheduled sequence computes its tokens (SCORE sequences sample nothing)."""
    out = sched.schedule()
    return out.num_scheduled_tokens, sched.update_from_output(out, StepOutput(), lambda seq, token: None)


def test_forks_run_in_waves_and_the_prefix_is_computed_once():
    manager = KVCacheManager(num_blocks=200, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=100)
    group = choice_group(prompt_len=10, num_candidates=11)
    sched.add(group.prefix)
    scheduled, _ = step(sched)
    assert scheduled == {group.prefix: 9}  # the prompt but its last token
    assert group.prefix.status is SequenceStatus.HELD and len(sched.running) == 4
    held_blocks = list(group.prefix.blocks)
    finished = []
    while sched.has_unfinished():
        scheduled, done = step(sched)
        finished += done
        assert len(scheduled) <= 4 and group.prefix not in scheduled  # never recomputed
        assert all(n == 1 + 3 for n in scheduled.values())  # each fork: the last prompt token and its candidate
        if group.prefix.status is SequenceStatus.HELD:
            assert group.prefix.blocks == held_blocks
    assert [seq.sample_index for seq in finished] == list(range(11))  # in order, each once
    assert group.prefix.status is SequenceStatus.FINISHED and group.prefix.blocks == []
    assert manager.num_free_blocks == 200


def test_abort_mid_wave_frees_the_prefix_and_the_wave():
    manager = KVCacheManager(num_blocks=200, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=100)
    group = choice_group(prompt_len=10, num_candidates=11)
    sched.add(group.prefix)
    step(sched)
    step(sched)  # the first wave done, the second started
    assert group.prefix.status is SequenceStatus.HELD and manager.num_free_blocks < 200
    for seq in group.sequences:  # as Engine.abort does
        if seq.status is not SequenceStatus.FINISHED:
            sched.abort(seq)
    assert not sched.has_unfinished() and manager.num_free_blocks == 200


@pytest.mark.parametrize("caching", [True, False])
def test_a_held_prefix_gives_its_blocks_back_when_nothing_else_can(caching):
    """A pool that holds the prompt and one candidate, but not a second copy of the prompt's last block (nor, without
    the prefix cache, a fork's own copy of the prompt): the held PREFIX is requeued, recomputed, and every candidate
    still finishes."""
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=caching)
    sched = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=100)
    group = choice_group(prompt_len=14, num_candidates=5, candidate_len=6)  # 20 tokens: 5 blocks each
    sched.add(group.prefix)
    finished = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        finished += step(sched)[1]
    assert sorted(seq.sample_index for seq in finished) == list(range(5))
    assert group.prefix.num_preemptions > 0 and manager.num_free_blocks == 6


# -- the engine on the default model ---------------------------------------------------------------------------------

PROMPT = "Which label fits this ticket best? Ticket: the app crashes when I open the camera."
# 60 candidates in waves of 8 (the engine's max_num_seqs): 8 waves, as many as 300 in waves of 32 made, at a fifth of
# the forks to compute
CANDIDATES = labels(60)
WAVE = 8


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir):
    from batchgen.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir).encode(PROMPT)


def make_engine(model_dir, **overrides) -> Engine:
    args = dict(model=str(model_dir), dtype="float32", kv_cache_memory="64MiB", max_num_seqs=WAVE)
    return Engine(EngineArgs(**{**args, **overrides}))


def run_steps(engine: Engine, requests: list[Request]) -> tuple[dict, int]:
    """Every result by id, and the most sequences any step ran."""
    for request in requests:
        engine.add_request(request)
    results, most = {}, 0
    while engine.has_unfinished():
        for result in engine.step():
            results[result.request_id] = result
        most = max(most, engine.last_step.num_seqs)
    return results, most


@pytest.fixture(scope="module")
def all_at_once(default_model_dir, prompt_ids):
    """Every candidate forked at once (max_num_seqs above their number): the scores to match."""
    engine = make_engine(default_model_dir, max_num_seqs=len(CANDIDATES))
    results, most = run_steps(engine, [Request("choice", prompt_ids, SamplingParams(choice=CANDIDATES))])
    assert most == len(CANDIDATES)
    return results["choice"]


@pytest.mark.slow
def test_waves_give_the_same_scores_and_hold_at_most_a_wave(default_model_dir, prompt_ids, all_at_once):
    engine = make_engine(default_model_dir, max_num_seqs=WAVE)
    other = Request("other", prompt_ids, SamplingParams(max_tokens=12, temperature=0.0))
    results, most = run_steps(engine, [Request("choice", prompt_ids, SamplingParams(choice=CANDIDATES)), other])
    assert most <= WAVE + 1  # a wave of max_num_seqs forks, and the other request
    waves = results["choice"]
    assert waves.text == all_at_once.text and waves.token_ids == all_at_once.token_ids
    assert [c for c, _ in waves.choice_probs] == CANDIDATES
    assert waves.choice_logprobs == pytest.approx(all_at_once.choice_logprobs, abs=1e-4)
    assert [p for _, p in waves.choice_probs] == pytest.approx([p for _, p in all_at_once.choice_probs], abs=1e-5)
    assert results["other"].finish_reason == "length"
    # the KV blocks of a wave (and the other request), not one per candidate
    assert engine.stats()["kv_peak_blocks_used"] < len(CANDIDATES) // 3
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.kv_cache_manager.pool.num_blocks


def test_abort_mid_wave_frees_every_block(default_model_dir, prompt_ids):
    engine = make_engine(default_model_dir)
    engine.add_request(Request("choice", prompt_ids, SamplingParams(choice=CANDIDATES)))
    for _ in range(3):  # the prompt, then two waves
        assert engine.step() == []
    assert engine.last_step.num_seqs == WAVE
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks < pool.num_blocks
    assert engine.abort("choice")
    assert not engine.has_unfinished() and engine.step() == []
    assert pool.num_free_blocks == pool.num_blocks


# -- a job through the CLI: peak memory under the run's bound, and the plan's estimate within 10% ------------------

# The job's scale, a quarter of the 600 labels, 4,096-token steps, 512 MiB pool and 2,048-token context this test
# first ran at (the forks are its time): the same proportions, so each property below holds as it did there.
NUM_LABELS = 150  # 6 tokens each; a fork computes 7 (the prompt's last token and its label)
JOB_ENGINE = {"max_num_seqs": 64,  # 3 waves a row, as 600 labels in waves of 256 made
              "max_num_batched_tokens": 1024,  # holds 146 forks: fewer than a row's candidates
              "kv_cache_memory": "128MiB",  # 182 blocks: fewer than the 300 candidates' own blocks
              "max_model_len": 512}  # fewer than the 900 tokens of the labels one after another


@pytest.mark.slow
def test_a_choice_of_many_labels_stays_in_its_memory_estimate(tmp_path):
    """Two rows of NUM_LABELS labels of 6 tokens each: more candidates than a step's budget holds, which all at once
    made one step copy a partial block per candidate, every layer at once; more blocks than the pool; and, were
    every label one sequence after the prompt, more tokens than the context."""
    from batchgen.models.loader import resolve_model
    from batchgen_kernels import cpu_build

    resolve_model("default")  # converted and the kernels built before the plan: its estimate and the run are then a
    cpu_build.load()          # warm cache's, whichever test reached them first (a cold plan counts the conversion)
    tickets = ["I was charged twice for my order last week.", "The app crashes every time I open the camera."]
    pq.write_table(pa.table({"id": [0, 1], "ticket": tickets}), tmp_path / "in.parquet")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": "default",
        "input": {"path": str(tmp_path / "in.parquet"), "id_column": "id", "template": "Ticket: {ticket}",
                  "system_prompt": "You route customer support tickets. Answer with the label only."},
        "sampling": {"choice": labels(NUM_LABELS), "temperature": 0.0, "max_tokens": 4},
        "engine": JOB_ENGINE,
        "output": {"path": str(tmp_path / "out")}}, sort_keys=False))
    planned = subprocess.run([sys.executable, "-m", "batchgen", "plan", str(job)], capture_output=True, text=True,
                             timeout=600)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "fits" in planned.stdout and "does not fit" not in planned.stdout  # a row needs its prompt + one label
    estimate = float(re.search(r"peak RSS ~([0-9,]+) MiB", planned.stdout).group(1).replace(",", "")) * 2**20
    ran = run_cli(job)
    assert ran.returncode == 0, ran.stderr
    assert len(read(tmp_path / "out")) == 2 and set(read(tmp_path / "out")["text"]) <= set(labels(NUM_LABELS))
    summary = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    peak = summary["peak_memory_bytes"]
    assert peak < summary["memory_bound_bytes"], (peak / 2**20, summary["memory_bound_bytes"] / 2**20)
    assert abs(estimate - peak) / peak < 0.10, (estimate / 2**20, peak / 2**20)
