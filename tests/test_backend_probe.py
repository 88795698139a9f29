"""The attention backend fails safe (issue 11, item 2): Triton is probed once at engine start (a tiny kernel compiled
and launched); where it cannot run, `auto` falls back to the torch reference after one warning naming the cause and
the fix, recorded in the run's stats, and an explicit `triton` stops with exit 2 before the model loads. The probe is
made to fail by replacing its launch, and for real: a subprocess without a C compiler, and the CLI without a GPU
driver (this machine has no libcuda.so.1)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_resume import make_job

from batchgen.job.run_summary import summary_table
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine import startup
from batchgen.engine.errors import SettingError
from batchgen_kernels import BackendUnavailable, choose_backend, cpu_backend, get_backend, reference, triton_probe

pytest.importorskip("triton")  # without a GPU, conftest has set TRITON_INTERPRET=1

NO_COMPILER = RuntimeError("Failed to find C compiler. Please specify via CC environment variable or set "
                           "triton.knobs.build.impl.")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the probe runs on the CPU interpreted


@pytest.fixture
def failing_probe(monkeypatch):
    """The probe's launch raising what Triton raises without a C compiler; counts the launches."""
    launches = []

    def launch(device):
        launches.append(device)
        raise NO_COMPILER

    monkeypatch.setattr(triton_probe, "_results", {})
    monkeypatch.setattr(triton_probe, "launch", launch)
    return launches


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_probe_kernel_runs_here(monkeypatch):
    monkeypatch.setattr(triton_probe, "_results", {})
    assert triton_probe.problem(DEVICE) is None
    assert choose_backend(DEVICE, "triton").name == "triton"
    assert get_backend(DEVICE, "triton").__name__ == "batchgen_kernels.triton_backend"


def test_auto_falls_back_with_one_warning_naming_the_fix(failing_probe, caplog):
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="batchgen"):
        choice = startup.choose_attention("auto", cuda)
    assert choice.name == "torch" and "apt install gcc" in choice.problem
    assert choice.reason.startswith("torch reference: Triton cannot run on cuda: RuntimeError: Failed to find C ")
    [warning] = warnings_of(caplog)
    assert "Triton cannot run on cuda" in warning and "apt install gcc" in warning and "torch reference" in warning
    # later asks neither probe again nor hand out the Triton kernels; no second warning from the graphs
    assert get_backend(cuda, "auto") is reference and choose_backend(cuda).name == "torch"
    caplog.clear()
    assert startup.capture_decode_graphs(None, EngineArgs(model="x"), 512, cuda, choice) is None
    assert warnings_of(caplog) == []
    assert len(failing_probe) == 1


def test_explicit_triton_is_a_setting_error(failing_probe):
    with pytest.raises(SettingError) as info:
        startup.choose_attention("triton", torch.device("cuda"))
    assert info.value.key == "attention_backend"
    assert str(info.value).startswith("triton cannot run on cuda: RuntimeError: Failed to find C compiler")
    assert "apt install gcc" in str(info.value) and "attention_backend to auto" in str(info.value)
    with pytest.raises(BackendUnavailable, match="apt install gcc"):
        get_backend("cuda", "triton")


def test_other_backends_never_probe(failing_probe):
    assert startup.choose_attention("torch", torch.device("cuda")).name == "torch"
    assert choose_backend("cpu", "auto").name in ("cpu", "torch")
    assert failing_probe == []
    with pytest.raises(SettingError, match="the cpu attention backend runs on CPU tensors, not on cuda"):
        startup.choose_attention("cpu", torch.device("cuda"))


def test_explicit_triton_stops_the_engine_before_the_model_loads(failing_probe, monkeypatch, tiny_llama_dir):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(startup, "load_model", load_model)
    with pytest.raises(SettingError, match="apt install gcc"):
        Engine(EngineArgs(model=str(tiny_llama_dir), device="cpu", attention_backend="triton"))


def test_the_fallback_is_recorded_in_stats_and_summary(monkeypatch, tiny_llama_dir):
    """The same record for the CPU's own fallback (the C++ kernels not built): the run says what ran and why."""
    monkeypatch.setattr(cpu_backend, "available", lambda: False)
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory="4MiB",
                               max_num_seqs=2))
    [result] = engine.generate([Request(0, [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))])
    assert len(result.token_ids) == 3
    stats = engine.stats()
    assert stats["attention_backend"] == "torch"
    assert stats["attention_backend_reason"] == "torch reference: the C++ CPU kernels could not be built (the " \
                                                "warning above says why)"
    assert all(layer.self_attn.attn.backend is reference for layer in engine.model.model.layers)
    summary = {"rows": 1, "rows_ok": 1, "rows_error": 0, "prompt_tokens": 3, "cached_tokens": 0,
               "prefix_cache_hit_rate": 0.0, "output_tokens": 3, "output_tokens_per_s": 1.0, "wall_s": 3.0,
               "preemptions": 0, "peak_memory_bytes": 2**30, "engine_stats": stats}
    assert "  attention      torch reference: the C++ CPU kernels could not be built" in summary_table(summary, "out")


def test_a_missing_compiler_is_explained(tmp_path):
    """Triton's own launcher build, run with no compiler on PATH: the real exception, the real fix."""
    script = textwrap.dedent("""
        import triton.runtime.build as build
        from batchgen_kernels import triton_probe
        try:
            build.compile_module_from_src("int batchgen_probe;", "batchgen_probe_cc")
        except Exception as exc:
            print(triton_probe.explain(exc))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env.update(PATH=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("RuntimeError: Failed to find C compiler") and "apt install gcc" in out.stdout


def test_explain_names_the_fix_of_each_known_cause():
    cases = {
        NO_COMPILER: "apt install gcc",
        subprocess.CalledProcessError(1, ["gcc", "main.c"]): "apt install python3-dev",
        AssertionError("libcuda.so cannot found!\nPlease make sure GPU is set up"): "TRITON_LIBCUDA_PATH",
        RuntimeError("0 active drivers ([]). There should only be one."): "install the NVIDIA driver",
        ModuleNotFoundError("No module named 'triton'"): "pip install triton",
        ValueError("x" * 1000): "attention_backend: torch",
    }
    for exc, fix in cases.items():
        text = triton_probe.explain(exc)
        assert text.startswith(type(exc).__name__ + ": ") and fix in text and "\n" not in text and len(text) < 600


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU driver")
def test_cli_explicit_triton_without_a_gpu_driver_exits_2(tmp_path):
    """No monkeypatching: Triton outside its interpreter, on a machine without libcuda.so.1."""
    job = make_job(tmp_path, 2, engine={"attention_backend": "triton"})
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), "--set", "device=cpu"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=Path(__file__).parents[1])
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("batchgen: error: engine.attention_backend: triton cannot run on cpu: RuntimeError: ")
    assert "install the NVIDIA driver" in last and "Traceback" not in out.stderr
    assert not (tmp_path / "out" / "_SUCCESS").exists()

