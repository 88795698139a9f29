"""The one-thread measurements behind issue 10's CPU changes (docs/performance.md), on the default model's shapes:

  matmul       F.linear (MKL in fp32) against the oneDNN-packed PackedLinear, fp32 and bf16, 1-256 rows
  elementwise  the four elementwise chains of one layer: torch ops against the fused C++ kernels
  prefill      one layer's whole-prompt attention: SDPA with 3-D inputs (its math path) against 4-D (flash)

Usage: python dev/microbench_cpu_ops.py [matmul|elementwise|prefill ...] [--threads 1] [--reps 40]
Best-of-reps wall time; on a shared machine compare the ratios, not the absolute times."""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from batchgen.models.packed_linear import PackedLinear
from batchgen_kernels.elementwise import FusedCpuElementwise, TorchElementwise, get_elementwise

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def best(fn, reps: int) -> float:
    fn()
    fastest = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        fastest = min(fastest, time.perf_counter() - started)
    return fastest


def matmul(reps: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 8, 32, 64, 256):
            for name, (k, n) in SHAPES.items():
                x, w = torch.randn(rows, k).to(dtype), (torch.randn(n, k) / k**0.5).to(dtype)
                packed = PackedLinear(w, None)
                plain_s, packed_s = best(lambda: F.linear(x, w), reps), best(lambda: packed(x), reps)
                flops = 2 * rows * k * n
                print(f"matmul {str(dtype)[6:]:8s} rows {rows:4d} {name:8s} F.linear {plain_s * 1e6:9.1f} us "
                      f"({flops / plain_s / 1e9:6.1f} GFLOP/s)  packed {packed_s * 1e6:9.1f} us "
                      f"({flops / packed_s / 1e9:6.1f} GFLOP/s)  x{plain_s / packed_s:.2f}")


def elementwise(reps: int) -> None:
    if get_elementwise("cpu") is not FusedCpuElementwise:
        print("elementwise: the C++ kernels did not build; nothing to compare")
        return
    cos, sin = torch.randn(8192, 32), torch.randn(8192, 32)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 8, 64, 512, 4096):
            x, r, w = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype), torch.randn(576).to(dtype)
            qkv, gate_up = torch.randn(rows, 960).to(dtype), torch.randn(rows, 3072).to(dtype)
            positions = torch.randint(0, 8192, (rows,))

            def layer(ops):
                ops.rms_norm(x, w, 1e-5), ops.add_rms_norm(x, r, w, 1e-5)
                ops.rope_qk(qkv, positions, cos, sin, 9, 3, 64), ops.silu_mul(gate_up)
            torch_s, fused_s = best(lambda: layer(TorchElementwise), reps), best(lambda: layer(FusedCpuElementwise), reps)
            print(f"elementwise {str(dtype)[6:]:8s} rows {rows:5d}  torch {torch_s * 1e6:9.1f} us  fused "
                  f"{fused_s * 1e6:9.1f} us  x{torch_s / fused_s:.1f}")


def prefill(reps: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1024, 9, 64).to(dtype)
        k, v = (torch.randn(1024, 3, 64).to(dtype).repeat_interleave(3, dim=1) for _ in range(2))
        three_d = best(lambda: F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                               is_causal=True), reps)
        four_d = best(lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                             v.transpose(0, 1)[None], is_causal=True), reps)
        print(f"prefill {str(dtype)[6:]:8s} 1,024 tokens, 9 heads: 3-D {three_d * 1e3:.1f} ms  4-D {four_d * 1e3:.1f} ms"
              f"  x{three_d / four_d:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", nargs="*", default=["matmul", "elementwise", "prefill"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    benches = {"matmul": matmul, "elementwise": elementwise, "prefill": prefill}
    unknown = [what for what in args.what if what not in benches]
    if unknown:
        parser.error(f"unknown {', '.join(unknown)}; choose from {', '.join(benches)}")
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        for what in args.what:
            benches[what](args.reps)


if __name__ == "__main__":
    main()
