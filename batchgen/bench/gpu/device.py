"""The device under the GPU check: what it is, its measured copy bandwidth and matmul rate, and its memory."""
from __future__ import annotations

import gc
import math
import os
import platform
import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, reps: int, device: torch.device) -> float:
    """Best-of-reps seconds of fn() (CUDA events on the current stream on a GPU), after one warm-up call."""
    fn()
    best = math.inf
    for _ in range(reps):
        if device.type != "cuda":
            started = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - started)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30, reps: int = 10) -> float:
    """Bytes per second a large device-to-device copy moves, reads and writes counted (2 x nbytes per copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), reps, device)
    del src, dst
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device, n: int = 8192, reps: int = 10, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = best_time(lambda: a @ b, reps, device)
    return 2 * n**3 / seconds


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_memory_allocated(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def describe_device(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"}
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_bytes": props.total_memory,
            "sms": props.multi_processor_count}
