"""bf16 Linear on the 1B Llama shapes: oneDNN's packed matmul (PackedLinear's) against the AMX tile kernel
(csrc/amx/linear_amx.cpp; its brgemm path above --tile-rows), in GB/s of weight streamed and ms per call. With
--fixed-rows R also oneDNN in calls of exactly R rows, the last padded (batch-invariant bf16 where the AMX Linear does
not load: packed_linear._fixed_row_calls).

    PYTHONPATH=.:kernels python dev/microbench_linear_amx.py [--threads 2] [--rows 1,4,8,16,32,64,128] [--tile-rows 64]
"""
from __future__ import annotations

import argparse
import time

import torch

from batchgen.models.packed_linear import _fixed_row_calls
from batchgen_kernels import amx

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048),
          "lm_head": (2048, 49152)}


def best_ms(fn, seconds: float = 0.6) -> float:
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 4]  # lower quartile: the machine is shared


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16,32,64,128")
    parser.add_argument("--tile-rows", type=int, default=64)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--fixed-rows", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    amx.load_linear()
    print(f"threads {args.threads}; GB/s of weight (ms per call)")
    fixed = f" {f'oneDNN {args.fixed_rows}s':>16} {'speed-up':>8}" if args.fixed_rows else ""
    print(f"{'shape':>8} {'rows':>5} {'oneDNN':>16} {'AMX kernel':>16} {'speed-up':>8}{fixed}")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        packed = torch.ops.batchgen.linear_amx_pack(w)
        gb = w.numel() * 2 / 1e9
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k).to(torch.bfloat16)
            base = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))
            ours = best_ms(lambda: torch.ops.batchgen.linear_amx(x, packed, None, n, args.tile_rows))
            line = (f"{name:>8} {rows:>5} {gb / base * 1e3:7.1f} ({base:6.2f}) {gb / ours * 1e3:7.1f} ({ours:6.2f}) "
                    f"{base / ours:7.2f}x")
            if args.fixed_rows:
                calls = best_ms(lambda: _fixed_row_calls(x, onednn, None, args.fixed_rows))
                line += f" {gb / calls * 1e3:7.1f} ({calls:6.2f}) {calls / ours:7.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
