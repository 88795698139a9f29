"""One KV-budget rule and one figure of available memory, used by the engine's start-up, `batchgen plan` and
`batchgen run`'s pre-check alike: a cgroup limit lower than the machine's free memory is what all of them see."""
from __future__ import annotations

import pytest

from batchgen import machine
from batchgen.engine.engine_args import EngineArgs
from batchgen.engine.kv_pool import kv_cache_budget
from batchgen.job import JobConfigError, load_job
from batchgen.job.plan.estimate import make_plan
from batchgen.job.prepare import inspect_job

from test_plan import plan_cli, tiny_chat_model, write_input, write_job  # noqa: F401 (a fixture)

GiB = 2**30


def test_budget_rule():
    assert kv_cache_budget(EngineArgs(model="m", kv_cache_memory="3MiB"), "cpu") == (3 * 2**20, "'3MiB'")
    assert kv_cache_budget(EngineArgs(model="m"), "cpu") == (2 * GiB, "'2GiB'")  # the CPU default
    assert kv_cache_budget(EngineArgs(model="m", kv_cache_memory="1GiB"), "cuda") == (GiB, "'1GiB'")
    assert kv_cache_budget(EngineArgs(model="m"), "cuda") is None  # known once the model is on the device
    budget, source = kv_cache_budget(EngineArgs(model="m", gpu_memory_utilization=0.5), "cuda",
                                     lambda: (10 * GiB, GiB))
    assert budget == 4 * GiB and source.startswith("from gpu_memory_utilization 0.5 (4,294,967,296 bytes")


def test_cgroup_limit_caps_what_is_available(monkeypatch):
    monkeypatch.setattr(machine, "cgroup_room", lambda: GiB)
    available, source = machine.available_memory()
    assert available == GiB + machine.process_rss() and source.startswith("left under this cgroup's memory limit")
    monkeypatch.setattr(machine, "cgroup_room", lambda: None)
    assert machine.available_memory()[1].startswith("available (psutil)")


@pytest.fixture
def job_under_a_cgroup(tmp_path, tiny_chat_model, monkeypatch):
    """A job whose KV cache fits the machine but not a cgroup with 1 GiB left: sized from this process's own memory,
    which the figure adds (a test process that ran others holds GiBs)."""
    uncapped = machine.available_memory()[0]
    monkeypatch.setattr(machine, "cgroup_room", lambda: GiB)
    size_mib = machine.available_memory()[0] // 2**20 + 512
    assert size_mib * 2**20 < uncapped
    inputs = write_input(tmp_path / "in.parquet", ["hello", "world"])
    return write_job(tmp_path, tiny_chat_model, inputs, engine={"kv_cache_memory": f"{size_mib}MiB"}), size_mib


def test_run_refuses_a_kv_cache_over_the_cgroup_limit(job_under_a_cgroup):
    job, size_mib = job_under_a_cgroup
    with pytest.raises(JobConfigError, match=rf"engine.kv_cache_memory: '{size_mib}MiB' \(.* GiB\) is more than the "
                                             rf"memory available \(.* left under this cgroup's memory limit"):
        inspect_job(load_job(job))


def test_plan_refuses_it_the_same_way(job_under_a_cgroup):
    result = plan_cli(job_under_a_cgroup[0])
    assert result.exit_code == 2, result.output
    assert "left under this cgroup's memory limit" in result.output


def test_plan_measures_against_the_same_figure(tmp_path, tiny_chat_model, monkeypatch):
    monkeypatch.setattr(machine, "cgroup_room", lambda: 4 * GiB)
    inputs = write_input(tmp_path / "in.parquet", ["hello", "world"])
    made = make_plan(load_job(write_job(tmp_path, tiny_chat_model, inputs)), False, 10, None, tmp_path / "none.jsonl")
    assert made.available_source.startswith("left under this cgroup's memory limit")
    assert 4 * GiB < made.available <= 4 * GiB + machine.process_rss()
