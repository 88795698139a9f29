"""glibc malloc settings for CPU steps (batchgen/engine/host_malloc.py): a large activation freed and made again
must reuse the heap's pages instead of faulting in fresh ones every step."""
import os
import platform
import subprocess
import sys

import pytest

from batchgen.engine import host_malloc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

PAGES = (48 << 20) // 4096  # a 48 MiB activation: above glibc's largest dynamic mmap threshold (32 MiB)


def faults_per_step(configure: bool, **env) -> tuple[int, int]:
    """(the threshold keep_step_memory set, minor page faults in ten steps of making and filling a 48 MiB tensor,
    after ten such steps: the heap takes a few to settle), in a fresh interpreter."""
    code = f"""
import resource, torch
from batchgen.engine.host_malloc import keep_step_memory
threshold = keep_step_memory() if {configure} else 0
def step():
    torch.empty({PAGES * 4096}, dtype=torch.uint8).fill_(1)
for _ in range(10):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(threshold, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    clean = {k: v for k, v in os.environ.items() if k not in host_malloc.USER_SETTINGS and k != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env},
                            check=True)
    threshold, faults = result.stdout.split()
    return int(threshold), int(faults)


def test_a_freed_activation_is_reused_without_page_faults():
    assert faults_per_step(False) == (0, pytest.approx(10 * PAGES, rel=0.2))  # glibc's default: new pages each step
    threshold, faults = faults_per_step(True)
    assert threshold >= 32 << 20 and faults <= 1.1 * PAGES  # reused (a late step of the heap's growth allowed)


def test_malloc_settings_of_the_user_are_left_alone():
    assert faults_per_step(True, MALLOC_MMAP_THRESHOLD_="131072")[0] == 0
    assert faults_per_step(True, GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000")[0] == 0


def test_a_cpu_engine_sets_it_up_once_its_cache_is_allocated(tiny_llama_dir, monkeypatch):
    from batchgen.engine import EngineArgs, startup

    calls = []
    monkeypatch.setattr(startup, "keep_step_memory", lambda: calls.append("malloc") or 0)
    monkeypatch.setattr(startup, "ModelRunner", lambda *args: calls.append("runner"))
    startup.set_up(EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory="1MiB"))
    assert calls == ["runner", "malloc"]


def faults_of_a_load(prefault: bool) -> tuple[bool, int]:
    """(whether the heap reserved its region, minor page faults in making and filling four 48 MiB tensors after
    hand_over: a loader's new weights), in a fresh interpreter."""
    code = f"""
import resource, torch
from batchgen.engine.host_malloc import PrefaultedHeap
heap = PrefaultedHeap({4 * PAGES * 4096} if {prefault} else 0)
heap.hand_over()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
weights = [torch.empty({PAGES * 4096}, dtype=torch.uint8).fill_(1) for _ in range(4)]
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
heap.close()
print(heap.reserved, faults)
"""
    clean = {k: v for k, v in os.environ.items() if k not in host_malloc.USER_SETTINGS and k != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, check=True)
    reserved, faults = result.stdout.split()
    return reserved == "True", int(faults)


def test_a_prefaulted_heap_serves_the_weights_without_page_faults():
    assert faults_of_a_load(False) == (False, pytest.approx(4 * PAGES, rel=0.2))  # each new tensor: fresh pages
    reserved, faults = faults_of_a_load(True)
    assert not reserved and faults <= 0.05 * 4 * PAGES  # close() released the region; the tensors were carved from it
