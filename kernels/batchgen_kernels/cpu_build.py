"""Build the C++ CPU kernels once per machine and load them as torch ops (`torch.ops.batchgen.*`).

The shared library is compiled straight with the C++ compiler (no ninja, no setuptools: `torch.utils.cpp_extension`
needs ninja for `load`, and two source files need no build system) and cached under
`$BATCHGEN_CACHE_DIR/kernels/<key>/` (default `~/.cache/batchgen`, where converted models go too). The key hashes
everything the binary depends on: the source, torch's version and C++ ABI, the compiler's identity, the flags and the
CPU's feature flags (`-march=native` code built on an AVX-512 machine must not run on an AVX2-only one). A failed
build (no compiler, a compiler error, a cache directory that cannot be written, a library that does not load) logs
one warning and `load()` returns False: callers fall back to the torch reference, which computes the same.

Next to the library, a manifest written last records its size and sha256; a library whose manifest is missing or
does not match (a truncated file: loading one kills the process with SIGBUS) is built again, never loaded.

The same machinery builds the AMX library (amx.py: its own sources and flags, `LibrarySpec`), which stays out of the
main one so that nothing the main library holds needs more than the CPU it was built on.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .host import cache_root, cpuinfo_line

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))  # compiled into one library
HEADERS = sorted(CSRC.glob("*.h"))
LIBRARY_NAME = "batchgen_cpu_kernels.so"
MANIFEST_NAME = "manifest.json"
# -fopenmp: at::parallel_for is a header template that runs serially unless compiled with OpenMP; the library
# then links libgomp.so.1, the one torch has already loaded. -fno-math-errno lets the rounding in exp vectorize.
# BATCHGEN_CPU_MARCH replaces -march=native: x86-64-v3 builds what an AVX2-only CPU gets (tests, measurements).
# -std=c++20: torch 2.14's headers use C++20 concepts (`requires`); earlier torch compiles the same under it.
FLAGS = ["-O3", f"-march={os.environ.get('BATCHGEN_CPU_MARCH') or 'native'}", "-fno-math-errno", "-std=c++20",
         "-fPIC", "-shared", "-fopenmp"]


@dataclass(frozen=True)
class LibrarySpec:
    """One shared library: its file name, the sources compiled into it, the headers they include (part of its cache
    key) and the flags it adds to FLAGS."""
    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    flags: tuple[str, ...] = ()


MAIN = LibrarySpec(LIBRARY_NAME, tuple(SOURCES), tuple(HEADERS))


def cache_dir() -> Path:
    """Where built kernels are kept: under batchgen's cache root (host.py, the one definition)."""
    return cache_root() / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo's flags, or an ARM's Features), else what platform knows."""
    line = cpuinfo_line(("flags", "Features"))
    if line is not None:
        return " ".join(sorted(line.split()))
    return f"{platform.machine()} {platform.processor()}"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _command(compiler: str, output: Path, spec: LibrarySpec = MAIN) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [compiler, *FLAGS, *spec.flags, abi, *includes, *map(str, spec.sources), "-o", str(output),
            *[f"-L{path}" for path in lib_dirs], *[f"-Wl,-rpath,{path}" for path in lib_dirs], "-lc10", "-ltorch_cpu"]


def library_path(compiler: str, spec: LibrarySpec = MAIN) -> Path:
    """The cached library's path for this source, torch, compiler, flags and CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (*(source.read_bytes() for source in spec.sources + spec.headers), torch.__version__.encode(),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(), compiler.encode(), version.encode(),
                 " ".join(FLAGS + list(spec.flags)).encode(), _cpu_flags().encode(), sys.platform.encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / key.hexdigest()[:20] / spec.name


def _digest(path: Path) -> dict:
    """Size and sha256 of a regular file (the library is about 1 MB: hashing it costs milliseconds)."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # checked before opening: opening a FIFO would block
        raise OSError(f"{path} is not a regular file")
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        size = 0
        for chunk in iter(lambda: file.read(2**20), b""):
            sha.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": sha.hexdigest()}


def cached_problem(target: Path) -> str | None:
    """Why the cached library `target` must not be loaded, or None when it is the file its manifest describes."""
    manifest = target.with_name(MANIFEST_NAME)
    try:
        if not stat.S_ISREG(os.stat(manifest).st_mode):
            return f"{manifest} is not a regular file"
        recorded = json.loads(manifest.read_text())
    except FileNotFoundError:
        return "it has no manifest (built by an earlier version, or its build was cut short)"
    except (OSError, ValueError) as exc:
        return f"its manifest {manifest} cannot be read ({exc})"
    try:
        actual = _digest(target)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    if recorded != actual:
        return (f"it is {actual['size']:,} bytes with sha256 {actual['sha256'][:12]}..., not what its manifest "
                f"records (a truncated or damaged file)")
    return None


def _cache_setting() -> str:
    if os.environ.get("BATCHGEN_CACHE_DIR"):
        return f"BATCHGEN_CACHE_DIR={os.environ['BATCHGEN_CACHE_DIR']}"
    return "the default cache ~/.cache/batchgen (BATCHGEN_CACHE_DIR sets another)"


def _make_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(f"{_cache_setting()} cannot hold the built kernels: {directory} cannot be created "
                           f"({exc.strerror or exc}); set BATCHGEN_CACHE_DIR to a writable directory") from None


def build(compiler: str, target: Path, spec: LibrarySpec = MAIN) -> float:
    """Compile into a temporary file next to `target` and rename it into place (concurrent builders cannot see a
    half-written library), then write its manifest. Returns the seconds it took."""
    _make_dir(target.parent)
    started = time.perf_counter()
    fd, partial = tempfile.mkstemp(suffix=".so", prefix=".building-", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(_command(compiler, Path(partial), spec), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {result.stderr.strip()[-2000:]}")
        digest = _digest(Path(partial))
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    _write_atomically(target.with_name(MANIFEST_NAME), json.dumps(digest) + "\n")
    return time.perf_counter() - started


def _write_atomically(path: Path, text: str) -> None:
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


_built_seconds = 0.0  # compiling libraries, in this process (build_seconds)


def build_seconds() -> float:
    """Seconds this process has spent compiling kernel libraries so far (0.0 when each came from the cache): the
    one-off cost of a machine's first run, which the run's summary shows apart from its throughput."""
    return _built_seconds


def build_and_load(spec: LibrarySpec) -> None:
    """Build `spec` unless the cache holds it intact, and load it into this process; raises what went wrong."""
    global _built_seconds
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    target = library_path(compiler, spec)
    problem = cached_problem(target) if os.path.lexists(target) else "not built yet"
    if problem is None:
        logger.debug("CPU kernels: using %s", target)
    else:
        if os.path.lexists(target):  # without a manifest: an earlier version's build, no warning needed
            damaged = os.path.lexists(target.with_name(MANIFEST_NAME))
            (logger.warning if damaged else logger.info)(
                "CPU kernels: not loading the cached %s: %s; building it again", target, problem)
        seconds = build(compiler, target, spec)
        _built_seconds += seconds
        logger.info("CPU kernels: built %s in %.1f s (cached for later runs)", target, seconds)
    torch.ops.load_library(str(target))


@functools.lru_cache(maxsize=None)
def load() -> bool:
    """Build (once per machine) and load the kernels into this process; False, after one warning, if impossible."""
    if os.environ.get("BATCHGEN_NO_CPU_KERNELS"):
        return False
    try:
        build_and_load(MAIN)
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
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale, window):
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    @torch.library.register_fake("batchgen::apply_token_bitmask_")
    def _(logits, bitmask, rows):
        return None

    @torch.library.register_fake("batchgen::paged_prefill_")
    def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq, scale, window, out):
        return None

    @torch.library.register_fake("batchgen::paged_decode_int8")
    def _(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale, window):
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
