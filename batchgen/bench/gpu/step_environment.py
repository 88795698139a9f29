"""Step 0: the environment. The GPU and its driver; the versions of python, torch, triton and transformers; and
what Triton's first launch needs besides: a C compiler and Python's headers (it builds a small C launcher) and
libcuda.so.1. Nothing here raises: what is missing is listed, with what it breaks."""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

from batchgen.bench.checkout import git_commit

from .device import describe_device


def module_version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001 -- an absent or broken package: no version
        return None


def first_line(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def c_compiler() -> dict:
    """The compiler Triton would use: $CC, else gcc, else clang (triton/runtime/build.py)."""
    path = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    return {"path": path, "from_cc_variable": "CC" in os.environ,
            "version": first_line([path, "--version"]) if path else None}


def python_headers() -> dict:
    """Python.h where Triton looks for it (triton/runtime/build.py: the default scheme, posix_prefix for
    posix_local)."""
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    return {"include_dir": include, "python_h": (Path(include) / "Python.h").is_file()}


def libcuda() -> dict:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return {"loads": False, "reason": str(exc)}
    return {"loads": True}


def run_environment(args, record) -> bool:
    import torch

    cuda = torch.cuda.is_available()
    record["gpu"] = describe_device(torch.device("cuda" if cuda else "cpu"))
    record["driver"] = {
        "nvidia_smi": first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "cuda_runtime": torch.version.cuda,
        "cuda_available": cuda}
    record["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                          **{name: module_version(name) for name in ("triton", "transformers", "numpy",
                                                                     "safetensors", "pytest")}}
    record["c_compiler"] = c_compiler()
    record["python_headers"] = python_headers()
    record["libcuda"] = libcuda()
    record["git_commit"] = git_commit()
    needs = {"transformers": (record["versions"]["transformers"] is not None, "steps 2 and 3"),
             "pytest": (record["versions"]["pytest"] is not None, "step 1")}
    if args.device == "cuda":
        needs.update({
            "a CUDA device": (cuda, "every step after this one"),
            "triton": (record["versions"]["triton"] is not None, "the Triton kernels (the engine falls back to torch)"),
            "a C compiler": (record["c_compiler"]["path"] is not None,
                             "Triton's first launch (it builds its launcher): install gcc or set CC"),
            "Python.h": (record["python_headers"]["python_h"],
                         "Triton's first launch (it builds its launcher): install python3-dev"),
            "libcuda.so.1": (record["libcuda"]["loads"], "Triton's launches")})
    record["missing"] = {name: breaks for name, (present, breaks) in needs.items() if not present}
    return not record["missing"]
