"""Ahead-of-time compilation of the Triton kernels for a GPU this machine does not have (sm_90, sm_80).

Triton ships its own ptxas, so the whole compiler runs without a GPU. Three stand-ins make the real launch
wrappers (store_kv, paged_decode, paged_prefill) compile exactly what a real call would:
- a driver that reports the target (GPUTarget("cuda", 90, 32), ...) and never touches a device;
- JITFunction.run forced to compile without launching (warmup=True), recording each kernel it compiled;
- tensors on the `meta` device, laid out as the model lays them out (q and k fresh, v a view into the fused qkv
  projection, the caches views into one allocation), so the signature, pointer alignment, integer
  specialisations and constexprs are those of real calls.

For each compiled kernel it reads the shared memory it needs (metadata), its tensor-core instructions (wgmma or
mma in the PTX) and its registers and spills (`cuobjdump -res-usage`: a stack frame is spilled registers).
What only a GPU shows is not here: the numbers, the speed, and the launch itself (the launcher Triton builds with
the machine's C compiler, libcuda).

Run it in a process of its own, without TRITON_INTERPRET (which swaps in the interpreter when a kernel is
decorated) and with a fresh TRITON_CACHE_DIR, so that a cached binary cannot hide a failure:
`python -m batchgen_kernels.triton_aot --target sm_90` prints the engine's matrix. tests/test_triton_aot.py runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from . import triton_limits
from .triton_common import interpreting, triton_error_reason
from .triton_decode import MAX_SPLITS


@dataclass(frozen=True)
class Target:
    name: str
    arch: int  # compute capability as Triton writes it: 90 for sm_90
    shared_memory: int  # the most shared memory one block may use (opt-in), bytes


TARGETS = {t.name: t for t in (Target("sm_90", 90, 227 * 1024),   # H100, H200
                                Target("sm_80", 80, 163 * 1024))}  # A100

# The kernels whose inner loop is tl.dot: in bf16/fp16 it must run on tensor cores, without spills.
DOT_KERNELS = ("_decode_split_kernel", "_prefill_kernel")


@dataclass
class Variant:
    """One compiled kernel."""

    kernel: str
    hash: str
    shared: int  # bytes of shared memory per block
    registers: int
    spill_bytes: int  # the stack frame: registers spilled to local memory
    tensor_cores: str  # "wgmma", "mma" or ""


# ------------------------------------------------------------------------------------------ compile, don't launch

class _TargetDriver:
    """Stands in for Triton's CUDA driver: says which GPU to compile for; there is no device to launch on."""

    def __init__(self, target: Target) -> None:
        self.target = GPUTarget("cuda", target.arch, 32)

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        # A kernel keeps its compiled variants, and the target they were compiled for, per device: one device per
        # target, so that compiling for another target in the same process compiles again.
        return self.target.arch

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")


@contextmanager
def compile_only(target: Target) -> Iterator[list[tuple[str, object]]]:
    """Inside, a kernel launch compiles for `target` and launches nothing; yields the list of (kernel name,
    CompiledKernel) that every launch appends to (a cache hit appends the same kernel again)."""
    if interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: the kernels were decorated for the interpreter, not compiled")
    launched: list[tuple[str, object]] = []
    run = JITFunction.run

    def compile_without_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        launched.append((self.fn.__name__, kernel))
        return kernel

    previous = driver._active  # reset_active() would look for a real GPU driver
    driver.set_active(_TargetDriver(target))
    JITFunction.run = compile_without_launch
    try:
        yield launched
    finally:
        JITFunction.run = run
        driver.set_active(previous)


def analyse(name: str, kernel) -> Variant:
    ptx = kernel.asm["ptx"]
    tensor_cores = "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else ""
    usage = resource_usage(kernel.asm["cubin"])
    return Variant(name, kernel.hash, kernel.metadata.shared, usage["REG"], usage["STACK"], tensor_cores)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """`cuobjdump -res-usage` of one kernel's cubin: {"REG": 120, "STACK": 0, "SHARED": ..., "LOCAL": ...}."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([tool, "-res-usage", file.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in (part.split(":", 1) for part in line.split()
                                                if ":" in part and part.split(":", 1)[1].isdigit())}


# ------------------------------------------------------------------------------------------------------ cases

@dataclass(frozen=True)
class Case:
    """One model shape and the launches the engine makes for it: store, decode (per split count), prefill (per
    tile), the attention launches for a full layer and for a sliding-window one; `kv_int8`: over an int8 cache
    (engine.kv_cache_dtype: int8) with its scales, `dtype` being the model's. `planted`: a deliberately broken case,
    and why; the checker must report it."""

    dtype: str
    head_dim: int
    group: int = 4
    num_kv_heads: int = 2
    block_size: int = 16
    decode_splits: tuple[int, ...] = (1, 4)
    prefill_tiles: tuple[tuple[int, int] | None, ...] = (None,)  # None: the engine's (triton_prefill.prefill_launch)
    kv_int8: bool = False
    planted: str = ""

    @property
    def name(self) -> str:
        tiles = ",".join(f"{tile[0]}x{tile[1]}" if tile else "default" for tile in self.prefill_tiles)
        splits = ",".join(map(str, self.decode_splits))
        return (f"{self.dtype} D{self.head_dim} group {self.group} kv {self.num_kv_heads} block {self.block_size} "
                f"splits {splits} tiles {tiles}{' kv int8' if self.kv_int8 else ''}")


@dataclass
class CaseReport:
    case: Case
    target: str
    variants: list[Variant] = field(default_factory=list)
    error: str = ""
    problems: list[str] = field(default_factory=list)  # what fails the case
    notes: list[str] = field(default_factory=list)  # known and accepted: fp32 spills
    seconds: float = 0.0


def engine_cases() -> list[Case]:
    """A representative matrix, every kernel in each case. The engine's common shapes: head dim 64 and 128 with 4
    query heads per KV head (Llama-3.2-1B, Llama-3-8B), bf16 (its default on CUDA). The kernel tests' shapes: head
    dim 80 (padded to 128) with groups of 3 in fp16 and fp32, block size 32, split counts 3 and 8, the small prefill
    tiles. Multi-head attention (group 1), the largest group, and the edges of triton_limits' head dims per width
    (fp16 compiles as bf16 does: same width, same tiles). An int8 cache at the engine's common shapes, the kernel
    tests' fp32 one and the widest bf16 head."""
    return [
        Case("bfloat16", 64), Case("bfloat16", 128),
        Case("float16", 80, group=3, block_size=32, decode_splits=(3, 8)),
        Case("float32", 80, group=3, prefill_tiles=(None, (16, 16), (16, 32), (32, 16))),
        Case("bfloat16", 128, group=1, num_kv_heads=4),
        Case("bfloat16", 64, group=triton_limits.MAX_GROUP, num_kv_heads=1, decode_splits=(1, MAX_SPLITS)),
        *(Case(dtype, head_dim) for dtype, head_dim in edge_head_dims(("bfloat16", "float32"))),
        Case("bfloat16", 64, kv_int8=True), Case("bfloat16", 128, kv_int8=True),
        Case("float32", 80, group=3, kv_int8=True),
        Case("bfloat16", edge_head_dims(("bfloat16",))[-1][1], kv_int8=True),
    ]


def edge_head_dims(dtypes: tuple[str, ...]) -> list[tuple[str, int]]:
    """The smallest and the largest head dim triton_limits lets through, for each dtype."""
    return [(dtype, head_dim) for dtype in dtypes
            for head_dim in (triton_limits.MIN_HEAD_DIM,
                             triton_limits.MAX_HEAD_ROW_BYTES * 8 // torch.finfo(getattr(torch, dtype)).bits)]


PLANTED = [
    Case("bfloat16", 8, planted="head_dim 8, below triton_limits.MIN_HEAD_DIM: tl.dot cannot compile it"),
    Case("bfloat16", 128, decode_splits=(), prefill_tiles=((64, 256),),
         planted="a 64x256 prefill tile: its pipelined K/V tiles need more shared memory than the GPU has"),
]


def compile_case(case: Case, target: Target) -> CaseReport:
    """Compile every kernel of `case` for `target` through the real launch wrappers, then check it."""
    from . import triton_backend as tb

    report = CaseReport(case, target.name)
    started = time.monotonic()
    try:
        with compile_only(target) as launched:
            for call in case_calls(case, tb):
                call()
    except Exception as exc:  # noqa: BLE001 -- a compile error is the finding, reported with the case
        report.error = f"{type(exc).__name__}: {triton_error_reason(exc)}"
    seen = set()
    for name, kernel in launched:
        if kernel.hash not in seen:
            seen.add(kernel.hash)
            report.variants.append(analyse(name, kernel))
    report.seconds = round(time.monotonic() - started, 2)
    check(report, target)
    return report


def case_calls(case: Case, tb) -> list[Callable[[], object]]:
    """The launches of one step for `case`, on meta tensors laid out as the model's (see the module docstring)."""
    dtype = getattr(torch, case.dtype)
    d, kv_heads, q_heads = case.head_dim, case.num_kv_heads, case.num_kv_heads * case.group
    tokens, seqs, blocks, meta = 12, 4, 64, torch.device("meta")
    qkv = torch.empty(tokens, (q_heads + 2 * kv_heads) * d, dtype=dtype, device=meta)
    q = torch.empty(tokens, q_heads, d, dtype=dtype, device=meta)  # RoPE's output: fresh, contiguous
    k = torch.empty(tokens, kv_heads, d, dtype=dtype, device=meta)
    v = qkv[:, (q_heads + kv_heads) * d:].view(tokens, kv_heads, d)
    cache = torch.empty(2, 2, blocks, case.block_size, kv_heads, d, dtype=torch.int8 if case.kv_int8 else dtype,
                        device=meta)  # [layer, k/v, ...]
    k_cache, v_cache = cache[1, 0], cache[1, 1]
    scales = torch.empty(cache.shape[:-1], dtype=torch.float32, device=meta)  # an int8 cache's, laid out alike
    kv = {"kv_scales": (scales[1, 0], scales[1, 1])} if case.kv_int8 else {}
    slots = torch.empty(tokens, dtype=torch.int64, device=meta)
    tables = torch.empty(seqs, 9, dtype=torch.int32, device=meta)
    seq_lens = torch.empty(seqs, dtype=torch.int32, device=meta)
    starts = torch.empty(seqs + 1, dtype=torch.int32, device=meta)
    calls: list[Callable[[], object]] = [lambda: tb.store_kv(k, v, k_cache, v_cache, slots, **kv)]
    for window in (None, 512):  # not specialised on: the windowed launches compile no variant of their own
        for n in case.decode_splits:
            calls.append(lambda n=n, w=window: tb.paged_decode(q[:2], k_cache, v_cache, tables[:2], seq_lens[:2], 4096,
                                                               0.1, num_splits=n, window=w, **kv))
        for tile in case.prefill_tiles:
            m, n = tile or (None, None)
            calls.append(lambda m=m, n=n, w=window: tb.paged_prefill(
                q, k_cache, v_cache, starts, seq_lens, tables, first_seq=2, num_seqs=2, max_query_len=5, scale=0.1,
                block_m=m, block_n=n, window=w, **kv))
    return calls


def check(report: CaseReport, target: Target) -> None:
    """Fill report.problems (the case fails) and report.notes (known: spills in fp32, where nothing runs on tensor
    cores)."""
    if report.error:
        report.problems.append(f"does not compile: {report.error}")
    sixteen_bit = report.case.dtype in ("bfloat16", "float16")
    for v in report.variants:
        if v.shared > target.shared_memory:
            report.problems.append(f"{v.kernel} needs {v.shared:,} bytes of shared memory, more than the "
                                   f"{target.shared_memory:,} of {target.name}")
        if v.kernel not in DOT_KERNELS:
            continue
        if sixteen_bit and not v.tensor_cores:
            report.problems.append(f"{v.kernel} has no tensor-core instruction (wgmma / mma) in {report.case.dtype}")
        if v.spill_bytes and sixteen_bit:
            report.problems.append(f"{v.kernel} spills registers: {v.spill_bytes} bytes of stack per thread")
        elif v.spill_bytes:
            report.notes.append(f"{v.kernel} spills {v.spill_bytes} bytes of stack per thread (fp32: known)")


# --------------------------------------------------------------------------------------------------- the CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgen_kernels.triton_aot", description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="sm_90")
    parser.add_argument("--planted", action="store_true", help="the planted bugs instead of the engine's matrix")
    parser.add_argument("--json", metavar="PATH", help="also write the reports as JSON here")
    args = parser.parse_args(argv)
    target = TARGETS[args.target]
    reports = [compile_case(case, target) for case in (PLANTED if args.planted else engine_cases())]
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(report) for report in reports], out, indent=1)
    for report in reports:
        print(f"{'FAIL' if report.problems else 'ok'} {target.name} {report.case.name} ({report.seconds:.1f} s)")
        for v in report.variants:
            print(f"    {v.kernel}: shared {v.shared:,} B, {v.registers} registers, {v.spill_bytes} B spilled"
                  f"{', ' + v.tensor_cores if v.tensor_cores else ''}")
        for line in report.problems + report.notes:
            print(f"    {line}")
    return 1 if any(report.problems for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
