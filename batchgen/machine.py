"""Facts about the machine this process runs on, for everything that reports or decides by them: the engine's
`dtype: auto`, `batchgen plan`, the bench and roofline records. A leaf module: it imports nothing of batchgen
(/proc/cpuinfo is read by batchgen_kernels/host.py, which the kernels' build shares)."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# The instruction sets batchgen's CPU paths care about (bf16 and int8 dot products, AMX tiles): the ones a record
# lists as present or absent.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags(path: str | None = None) -> set[str] | None:
    """The first CPU's feature flags from /proc/cpuinfo (Linux x86), or None where there is no such file or line.
    /proc/cpuinfo is read in one place, batchgen_kernels/host.py, which the kernels' build cache shares."""
    from batchgen_kernels.host import CPUINFO, cpuinfo_line  # deferred: it loads torch (the package's __init__)

    line = cpuinfo_line(("flags",), path or CPUINFO)
    return None if line is None else set(line.split())


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    from batchgen_kernels.host import cpuinfo_line

    line = cpuinfo_line(("model name",))
    return line.strip() if line is not None else platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """The machine as records show it: CPU, cores, KERNEL_FLAGS present or not, memory, library versions."""
    import psutil
    import torch
    import transformers

    present = cpu_flags() or set()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "cpu_flags": {flag: flag in present for flag in KERNEL_FLAGS}, "ram_bytes": psutil.virtual_memory().total,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def process_rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def available_memory(device_type: str = "cpu") -> tuple[int, str]:
    """Bytes a run could use now, and where the figure comes from: what `batchgen plan` and the job's pre-check
    compare against. On the CPU: psutil's available memory, capped by this process's cgroup limit, plus this
    process's RSS (it is the run, or gives it back when it exits). On CUDA: the device's free memory."""
    if device_type == "cuda":
        import torch
        free, total = torch.cuda.mem_get_info()
        return free, f"free on {torch.cuda.get_device_name()} ({total / 2**30:,.1f} GiB in all)"
    available, what = free_memory()
    own = process_rss()
    return available + own, f"{what} + this process's {own / 2**20:,.0f} MiB"


def free_memory() -> tuple[int, str]:
    """Bytes of host memory free for more allocations now, and where the figure comes from: psutil's available
    memory, capped by this process's cgroup limit. The one reading of it (available_memory adds this process's)."""
    import psutil
    available, what = psutil.virtual_memory().available, "available (psutil)"
    limit = cgroup_room()
    if limit is not None and limit < available:
        available, what = limit, "left under this cgroup's memory limit"
    return available, what


def cgroup_room() -> int | None:
    """The memory limit minus the usage of this process's cgroup (v2 or v1), or None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            usage = int(Path("/sys/fs/cgroup", usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            return max(int(limit) - usage, 0)
    return None
