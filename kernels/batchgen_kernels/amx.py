"""bf16 prefill attention on AMX tiles (csrc/amx/paged_prefill_amx.cpp), on the CPUs that have them.

Its library is built apart from the main one (cpu_build.MAIN), with AMX and AVX-512 flags that only it gets, and is
built and loaded only on a CPU whose flags include all of REQUIRED_FLAGS, after Linux has granted this process the AMX
tile state: a process must ask for it (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) before its first tile
instruction, which would otherwise kill it. Where any of that fails — the flags, a refused request, a compiler without
AMX, `BATCHGEN_CPU_MARCH` building for another CPU — bf16 prefills stay on the main library's kernel (AVX512_BF16 dot
products), which computes the same; `BATCHGEN_NO_AMX=1` keeps them there on an AMX CPU too (to compare the two).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import platform
import sys
from dataclasses import dataclass

import torch

from . import cpu_build

logger = logging.getLogger(__name__)

# The tile instructions and the AVX-512 the softmax and the bf16 rounding are compiled for.
REQUIRED_FLAGS = ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
FLAGS = ("-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16")
SOURCE_DIR = cpu_build.CSRC / "amx"
# The bf16 Linear (linear_amx.cpp) is a library of its own, built only where asked for (load_linear): batch-invariant
# bf16 runs every Linear on its tile path (models/packed_linear.py); otherwise the engine keeps oneDNN's matmul
# (docs/performance.md, "Issue 43").
LINEAR_SOURCE = SOURCE_DIR / "linear_amx.cpp"
HEADERS = tuple(cpu_build.HEADERS) + tuple(sorted(SOURCE_DIR.glob("*.h")))
SPEC = cpu_build.LibrarySpec("batchgen_cpu_amx.so",
                             tuple(sorted(set(SOURCE_DIR.glob("*.cpp")) - {LINEAR_SOURCE})), HEADERS, FLAGS)
LINEAR = cpu_build.LibrarySpec("batchgen_cpu_amx_linear.so", (LINEAR_SOURCE,), HEADERS, FLAGS)
# The same kernel on the tiles' scalar emulation (amx_tiles.h), which runs on any CPU: how the kernel's packing,
# tiling and softmax are tested where there is no AMX (tests/test_cpu_kernels_amx.py). Never loaded by a run.
EMULATED = dataclasses.replace(SPEC, name="batchgen_cpu_amx_emulated.so", flags=("-DBATCHGEN_AMX_EMULATE",))

# Linux x86-64: the arch_prctl system call and its two requests for the extended state components a process may use.
SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1022, 0x1023, 18


@dataclass(frozen=True)
class AmxStatus:
    available: bool  # bf16 prefills run on AMX tiles in this process
    reason: str  # why (not), in a few words


def missing_flags(flags: set[str]) -> list[str]:
    return [flag for flag in REQUIRED_FLAGS if flag not in flags]


def request_tile_state() -> str | None:
    """Ask Linux for the AMX tile state for this process (all of its threads, for its lifetime); None once it is
    granted, else why not."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"AMX tile state is requested on Linux x86-64 only, not {sys.platform} {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        return (f"Linux refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): "
                f"{os.strerror(ctypes.get_errno())})")
    granted = ctypes.c_ulong(0)
    if (libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(granted)) != 0
            or not granted.value >> XFEATURE_XTILEDATA & 1):
        return "Linux accepted the request for the AMX tile state but does not list it as granted"
    return None


@functools.lru_cache(maxsize=None)
def status() -> AmxStatus:
    """Whether bf16 prefills run on AMX tiles here, building and loading the AMX library on first call where they
    can (once per machine: it is cached as the main library is). One warning where a CPU with AMX cannot use it."""
    if os.environ.get("BATCHGEN_NO_CPU_KERNELS") or os.environ.get("BATCHGEN_NO_AMX"):
        return AmxStatus(False, "turned off (BATCHGEN_NO_CPU_KERNELS or BATCHGEN_NO_AMX)")
    if os.environ.get("BATCHGEN_CPU_MARCH"):
        return AmxStatus(False, f"BATCHGEN_CPU_MARCH={os.environ['BATCHGEN_CPU_MARCH']} builds for another CPU")
    missing = missing_flags(set(cpu_build._cpu_flags().split()))
    if missing:
        return AmxStatus(False, f"the CPU lacks {', '.join(missing)}")
    try:
        problem = request_tile_state()
        if problem is not None:
            raise RuntimeError(problem)
        cpu_build.build_and_load(SPEC)
        _register_fake()
    except Exception as exc:  # noqa: BLE001 -- the main library's kernel computes the same
        logger.warning("AMX kernels unavailable, bf16 prefills use the AVX-512 kernel: %s: %s", type(exc).__name__, exc)
        return AmxStatus(False, f"AMX unusable here: {exc}")
    return AmxStatus(True, "bf16 prefill on AMX tiles")


def available() -> bool:
    return status().available


@functools.lru_cache(maxsize=None)  # once per process: status() may be asked again after cache_clear (the tests)
def _register_fake() -> None:
    @torch.library.register_fake("batchgen::paged_prefill_amx_")
    def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq, scale, window, out):
        return None


@functools.lru_cache(maxsize=None)
def load_linear() -> None:
    """Build (once per machine) and load the AMX bf16 Linear: torch.ops.batchgen.linear_amx_pack / linear_amx. Only
    where status() is available (the tile state granted)."""
    if not available():
        raise RuntimeError(f"no AMX tiles here: {status().reason}")
    cpu_build.build_and_load(LINEAR)

    @torch.library.register_fake("batchgen::linear_amx_pack")
    def _(weight):
        blocks, padded_k = -(-weight.shape[0] // 32), -(-weight.shape[1] // 32) * 32
        return weight.new_empty(blocks, padded_k // 2, 32, 2)

    @torch.library.register_fake("batchgen::linear_amx")
    def _(x, packed, bias, n, tile_rows):
        return x.new_empty(*x.shape[:-1], n)
