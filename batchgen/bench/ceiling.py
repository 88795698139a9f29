"""The machine's ceiling for this bench: fp32 matmul FLOP/s through torch, measured in the same process and run,
and the share of it a system reaches while decoding (2 x parameters x output tokens / generation wall time; this
counts the weight matmuls of generated tokens only, not prefill nor attention)."""
from __future__ import annotations

import time


def matmul_flops(n: int = 2048, reps: int = 5) -> dict:
    """Best-of-`reps` FLOP/s of an n x n fp32 matmul, with the thread count torch uses for everything else."""
    import torch

    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    torch.mm(a, b)  # warm-up: thread pool, allocator
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return {"matmul_n": n, "reps": reps, "best_s": best, "flops": 2 * n**3 / best, "threads": torch.get_num_threads()}


def decode_share(parameters: int, output_tokens: int, wall_s: float, ceiling_flops: float) -> dict:
    achieved = 2 * parameters * output_tokens / wall_s if wall_s > 0 else 0.0
    return {"parameters": parameters, "decode_flops": achieved,
            "share_of_ceiling": achieved / ceiling_flops if ceiling_flops else None,
            "note": "decode FLOPs only: 2 x parameters x output tokens / generation wall time"}
