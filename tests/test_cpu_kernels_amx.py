"""The AMX prefill kernel on every CPU (kernels/batchgen_kernels/amx.py): the library an AMX machine builds compiles
here, with its tile instructions in it (only compiled: on a CPU without AMX they would fault); the same kernel on the
tiles' scalar emulation passes test_cpu_prefill_amx.py's cases against the torch reference; and a CPU without AMX, or
a process refused the tile state, keeps bf16 prefills on the main library's kernel. Where the CPU has AMX,
test_cpu_prefill_amx.py also runs on the real instructions."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen_kernels import amx, choose_backend, cpu_build

ROOT = Path(__file__).resolve().parents[1]
CPU_FLAGS = set(cpu_build._cpu_flags().split())

needs_compiler = pytest.mark.skipif(cpu_build._compiler() is None, reason="no C++ compiler")

EMULATED_SCRIPT = """
import sys, pytest
from batchgen_kernels import amx, cpu_build
cpu_build.build_and_load(amx.EMULATED)
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "tests/test_cpu_prefill_amx.py"]))
"""


@needs_compiler
def test_the_amx_library_compiles_with_its_tile_instructions(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    assert not set(amx.SPEC.sources) & set(cpu_build.SOURCES), "the AMX kernel leaked into the main library"
    compiler = cpu_build._compiler()
    target = cpu_build.library_path(compiler, amx.SPEC)
    cpu_build.build(compiler, target, amx.SPEC)
    assert cpu_build.cached_problem(target) is None
    disassembly = subprocess.run(["objdump", "-d", str(target)], capture_output=True, text=True)
    if disassembly.returncode != 0:
        pytest.skip("no objdump to look inside the library")
    for instruction in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"):
        assert instruction in disassembly.stdout, instruction


@needs_compiler
def test_the_kernel_on_emulated_tiles_passes_the_amx_prefill_tests():
    env = {**os.environ, "BATCHGEN_NO_AMX": "1",  # this process must load the emulation, never the real library
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels"), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-c", EMULATED_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert " passed" in result.stdout  # not a module skipped as a whole (exit status 0 too)


@pytest.mark.skipif(not amx.missing_flags(CPU_FLAGS), reason="this CPU has AMX")
def test_without_amx_bf16_prefills_stay_on_the_main_kernel():
    status = amx.status()
    assert not status.available
    assert "lacks" in status.reason and "amx_tile" in status.reason
    assert "AMX" not in choose_backend("cpu", "cpu").reason


linux_x86_64 = sys.platform == "linux" and os.uname().machine == "x86_64"


@pytest.mark.skipif("amx_tile" in CPU_FLAGS or not linux_x86_64,
                    reason="needs Linux on an x86-64 CPU without AMX (whose kernel refuses the tile state)")
def test_a_refused_tile_state_falls_back_after_one_warning(monkeypatch, tmp_path, caplog):
    """Told the CPU has every flag it needs, status() asks Linux for the tile state, which this CPU's kernel refuses:
    one warning, no AMX, nothing built."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: " ".join(sorted(CPU_FLAGS | set(amx.REQUIRED_FLAGS))))
    amx.status.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            status = amx.status()
    finally:
        amx.status.cache_clear()
    assert not status.available
    assert "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)" in status.reason
    assert [r.getMessage() for r in caplog.records if "AMX kernels unavailable" in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert not (tmp_path / "kernels").exists()


@pytest.mark.skipif(not linux_x86_64, reason="the tile state is requested on Linux x86-64")
def test_the_tile_state_request_answers_for_this_cpu():
    problem = amx.request_tile_state()
    if "amx_tile" in CPU_FLAGS:
        assert problem is None
    else:
        assert problem is not None and "refused" in problem


@pytest.mark.parametrize("setting", ["BATCHGEN_NO_AMX", "BATCHGEN_CPU_MARCH"])
def test_settings_that_keep_amx_off(monkeypatch, setting):
    monkeypatch.setenv(setting, "x86-64-v3" if setting == "BATCHGEN_CPU_MARCH" else "1")
    amx.status.cache_clear()
    try:
        assert not amx.status().available and setting in amx.status().reason
    finally:
        amx.status.cache_clear()
