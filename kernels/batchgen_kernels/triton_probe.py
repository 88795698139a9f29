"""Can the Triton kernels run here? One tiny kernel compiled and launched on the device, once per device and process.

A first Triton launch needs more than Triton: it builds a small C launcher with the machine's C compiler and Python
headers, links it against the driver's libcuda.so.1, and runs ptxas. Any of these missing surfaces only at the first
kernel call, deep in a traceback; the probe finds it before anything relies on the kernels and says how to fix it.
"""
from __future__ import annotations

import subprocess

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # what the probe reports
    triton, IMPORT_ERROR = None, exc

PROBE_SIZE = 32

# (text in the exception, the fix), first match wins
FIXES = (
    ("Failed to find C compiler", "install a C compiler (apt install gcc) or point CC at one: Triton builds its "
                                  "kernel launcher with it"),
    ("libcuda", "libcuda.so.1 (the NVIDIA driver's library) was not found: install the driver, run ldconfig, or set "
                "TRITON_LIBCUDA_PATH to the directory that holds it"),
    ("active drivers", "Triton found no usable GPU driver (libcuda.so.1 missing, or no device): install the NVIDIA "
                       "driver or set TRITON_LIBCUDA_PATH; on a CPU the kernels run only under TRITON_INTERPRET=1"),
)
NOT_INSTALLED = "install Triton: pip install triton"
COMPILER_FAILED = ("the C compiler could not build Triton's launcher (its error is printed above); the usual cause is "
                   "missing Python headers: apt install python3-dev (or your Python's -dev package)")
OTHER = "run with attention_backend: torch, or fix what the error says"

_results: dict[str, str | None] = {}


def problem(device: torch.device | str) -> str | None:
    """None when a tiny Triton kernel compiles, launches and computes the right values on `device`; else what went
    wrong and how to fix it. Probed once per device; later calls return the first answer."""
    key = str(torch.device(device))
    if key not in _results:
        try:
            launch(torch.device(device))
            _results[key] = None
        except Exception as exc:  # noqa: BLE001 -- any failure means: not these kernels, here
            _results[key] = explain(exc)
    return _results[key]


def launch(device: torch.device) -> None:
    """Compile and run the probe kernel on `device` (raises whatever stops it); also imports the real kernels."""
    if triton is None:
        raise IMPORT_ERROR
    from . import triton_backend  # noqa: F401 -- the engine's kernels must import too
    x = torch.arange(PROBE_SIZE, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    if device.type == "cuda":
        with torch.cuda.device(device):
            _add_one[(1,)](x, y, PROBE_SIZE, BLOCK=PROBE_SIZE)
            torch.cuda.synchronize(device)
    else:
        _add_one[(1,)](x, y, PROBE_SIZE, BLOCK=PROBE_SIZE)
    if not torch.equal(y, x + 1):
        raise RuntimeError("the probe kernel ran but computed wrong values")


def explain(exc: BaseException) -> str:
    """The exception in one line, and the fix for the causes we know."""
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:300] + " ..."
    if isinstance(exc, ModuleNotFoundError):
        fix = NOT_INSTALLED
    elif isinstance(exc, subprocess.CalledProcessError):
        fix = COMPILER_FAILED
    else:
        fix = next((hint for needle, hint in FIXES if needle in text), OTHER)
    return f"{type(exc).__name__}: {text}; fix: {fix}"


if triton is not None:
    @triton.jit
    def _add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)
