"""Build the C++ CPU kernels once per machine and load them as torch ops (`torch.ops.batchgen.*`).

The shared library is compiled straight with the C++ compiler (no ninja, no setuptools: `torch.utils.cpp_extension`
needs ninja for `load`, and two source files need no build system) and cached under
`$BATCHGEN_CACHE_DIR/kernels/<key>/` (default `~/.cache/batchgen`, where converted models go too). The key hashes
everything the binary depends on: the source, torch's version and C++ ABI, the compiler's identity, the flags and the
CPU's feature flags (`-march=native` code built on an AVX-512 machine must not run on an AVX2-only one). A failed
build (no compiler, a compiler error, a library that does not load) logs one warning and `load()` returns False:
callers fall back to the torch reference.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))  # compiled into one library
HEADERS = sorted(CSRC.glob("*.h"))
LIBRARY_NAME = "batchgen_cpu_kernels.so"
# -fopenmp: at::parallel_for is a header template that runs serially unless compiled with OpenMP; the library
# then links libgomp.so.1, the one torch has already loaded. -fno-math-errno lets the rounding in exp vectorize.
# BATCHGEN_CPU_MARCH replaces -march=native: x86-64-v3 builds what an AVX2-only CPU gets (tests, measurements).
FLAGS = ["-O3", f"-march={os.environ.get('BATCHGEN_CPU_MARCH') or 'native'}", "-fno-math-errno", "-std=c++17",
         "-fPIC", "-shared", "-fopenmp"]


def cache_dir() -> Path:
    """Where built kernels are kept (the same root as loader.cache_root, which this package cannot import)."""
    root = Path(os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen")
    return root / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo), else what platform knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _command(compiler: str, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [compiler, *FLAGS, abi, *includes, *map(str, SOURCES), "-o", str(output),
            *[f"-L{path}" for path in lib_dirs], *[f"-Wl,-rpath,{path}" for path in lib_dirs], "-lc10", "-ltorch_cpu"]


def library_path(compiler: str) -> Path:
    """The cached library's path for this source, torch, compiler, flags and CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES + HEADERS), torch.__version__.encode(), str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
                 compiler.encode(), version.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode(),
                 sys.platform.encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / key.hexdigest()[:20] / LIBRARY_NAME


def build(compiler: str, target: Path) -> float:
    """Compile into a temporary file next to `target` and rename it into place (concurrent builders cannot see a
    half-written library). Returns the seconds it took."""
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    fd, partial = tempfile.mkstemp(suffix=".so", prefix=".building-", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(_command(compiler, Path(partial)), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return time.perf_counter() - started


@functools.lru_cache(maxsize=None)
def load() -> bool:
    """Build (once per machine) and load the kernels into this process; False, after one warning, if impossible."""
    if os.environ.get("BATCHGEN_NO_CPU_KERNELS"):
        return False
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
        target = library_path(compiler)
        if target.exists():
            logger.debug("CPU kernels: using %s", target)
        else:
            seconds = build(compiler, target)
            logger.info("CPU kernels: built %s in %.1f s (cached for later runs)", target, seconds)
        torch.ops.load_library(str(target))
        _register_fake()
    except Exception as exc:  # noqa: BLE001 -- the torch reference computes the same thing, only slower
        logger.warning("CPU kernels unavailable, using torch ops instead: %s: %s",
                       type(exc).__name__, exc)
        return False
    return True


def _register_fake() -> None:
    """Shapes for tracing (torch.compile, fake tensors): paged_decode returns q's shape and dtype; paged_prefill_
    writes into its `out` argument."""
    @torch.library.register_fake("batchgen::paged_decode")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    @torch.library.register_fake("batchgen::apply_token_bitmask_")
    def _(logits, bitmask, rows):
        return None

    @torch.library.register_fake("batchgen::paged_prefill_")
    def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq, scale, out):
        return None
