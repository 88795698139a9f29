"""The machine's rates for this bench, measured through torch in the same process and run: matmul FLOP/s (per
dtype) and memory read bandwidth; and the share of the matmul rate a system reaches while decoding (2 x parameters
x output tokens / generation wall time; this counts the weight matmuls of generated tokens only, not prefill nor
attention). `roofline.py` sets its floors from the same two rates."""
from __future__ import annotations

import statistics
import time


SLOW_MATMUL_S = 2.0  # a warm-up matmul slower than this: the kernel is timed twice instead of `reps` times


def matmul_flops(n: int = 2048, reps: int = 5, dtype: str = "float32") -> dict:
    """Best-of-`reps` FLOP/s of an n x n matmul in `dtype`, with the thread count torch uses for everything else:
    the fastest of torch's default matmul (`torch.mm`; MKL for fp32), the oneDNN packed kernel batchgen's CPU
    linear layers use (models/packed_linear.py) or, for bf16 on a CPU without native bf16, instead of torch.mm (its
    bf16 fallback: ~0.3 GFLOP/s there) the fp32 path batchgen's bf16 layers take (models/upcast_linear.py),
    whichever the machine runs faster: that is its matmul rate."""
    import torch

    from batchgen.models.packed_linear import PackedLinear, packing_supported
    from batchgen.models.upcast_linear import UpcastLinear, upcast_supported

    torch_dtype = getattr(torch, dtype)
    a = torch.randn(n, n).to(torch_dtype)
    b = torch.randn(n, n).to(torch_dtype)
    kernels = {}
    if upcast_supported(torch.device("cpu"), torch_dtype):  # torch.mm's fallback would take minutes, for nothing
        upcast = UpcastLinear(b, None)
        kernels["upcast to fp32"] = lambda: upcast(a)
    else:
        kernels["torch.mm"] = lambda: torch.mm(a, b)
    if packing_supported(torch.device("cpu"), torch_dtype):
        packed = PackedLinear(b, None)
        kernels["onednn packed"] = lambda: packed(a)
    best, used_reps = {}, {}
    for name, run in kernels.items():
        started = time.perf_counter()
        run()  # warm-up: thread pool, allocator, the kernel's packing buffers
        # A kernel this slow (bf16 without native bf16: ~1 GFLOP/s, a minute a matmul) is timed twice, not `reps`
        used_reps[name] = reps if time.perf_counter() - started < SLOW_MATMUL_S else min(reps, 2)
        best[name] = float("inf")
        for _ in range(used_reps[name]):
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    kernel = min(best, key=best.get)
    return {"dtype": dtype, "matmul_n": n, "reps": used_reps[kernel], "best_s": best[kernel],
            "flops": 2 * n**3 / best[kernel],
            "kernel": kernel, "by_kernel_flops": {k: 2 * n**3 / s for k, s in best.items()},
            "threads": torch.get_num_threads()}


def memory_bandwidth(nbytes: int = 2**30, reps: int = 7) -> dict:
    """Best-of-`reps` read bandwidth (bytes/s) of a sum over an fp32 tensor of `nbytes`, far larger than the caches
    by default, with torch's thread count. A sum does one add per 4 bytes read: memory, not arithmetic, bounds it."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)  # written once: every page resident before the clock starts
    x.sum()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - started)
    best = min(times)
    return {"bytes": x.numel() * 4, "reps": reps, "best_s": best, "median_s": statistics.median(times),
            "bytes_per_s": x.numel() * 4 / best, "threads": torch.get_num_threads()}


def decode_share(parameters: int, output_tokens: int, wall_s: float, ceiling_flops: float) -> dict:
    achieved = 2 * parameters * output_tokens / wall_s if wall_s > 0 else 0.0
    return {"parameters": parameters, "decode_flops": achieved,
            "share_of_ceiling": achieved / ceiling_flops if ceiling_flops else None,
            "note": "decode FLOPs only: 2 x parameters x output tokens / generation wall time"}
