"""How fast this machine can read a paged KV cache at all: a C++ loop that only sums K and V, block by block, in the
decode kernel's order (each sequence's blocks through its block table, K block then V block), on torch's thread
count. Its rate is the most a decode attention kernel over this layout can reach, next to the roofline's probe (a sum
over one contiguous GiB). Blocks as the default model's: 16 tokens x 3 kv heads x 64 dims, fp32 (12 KiB).

  python dev/kv_read_bandwidth.py [--seqs 32] [--blocks 64] [--layers 4] [--threads 2]

Prints GB/s for consecutive blocks (a sequence's blocks side by side, as a fresh pool hands them out) and shuffled
ones (a pool after much reuse), each with and without software prefetch of the next block's first lines.
Needs a C++ compiler (the one the kernels are built with)."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
typedef float Vec16 __attribute__((vector_size(64)));
int main(int argc, char** argv) {
  const long seqs = atol(argv[1]), width = atol(argv[2]), layers = atol(argv[3]);
  const int threads = atoi(argv[4]), shuffled = atoi(argv[5]), prefetch_lines = atoi(argv[6]);
  const long block = 16 * 3 * 64, blocks = seqs * width;  // floats per block
  std::vector<float*> k(layers), v(layers);
  for (long l = 0; l < layers; ++l) {
    k[l] = static_cast<float*>(aligned_alloc(64, blocks * block * 4));
    v[l] = static_cast<float*>(aligned_alloc(64, blocks * block * 4));
    for (long i = 0; i < blocks * block; ++i) k[l][i] = v[l][i] = 1e-3f * (i % 7);
  }
  std::vector<long> table(blocks);
  for (long i = 0; i < blocks; ++i) table[i] = i;
  if (shuffled) std::shuffle(table.begin(), table.end(), std::mt19937(0));
  double best = 1e30;
  float sink = 0;
  for (int rep = 0; rep < 10; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (long l = 0; l < layers; ++l) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(+ : sink)
      for (long s = 0; s < seqs; ++s) {
        Vec16 acc = {};
        for (long b = 0; b < width; ++b) {
          const float* kb = k[l] + table[s * width + b] * block;
          const float* vb = v[l] + table[s * width + b] * block;
          if (b + 1 < width)
            for (int line = 0; line < prefetch_lines; ++line) {
              __builtin_prefetch(k[l] + table[s * width + b + 1] * block + 16 * line, 0, 2);
              __builtin_prefetch(v[l] + table[s * width + b + 1] * block + 16 * line, 0, 2);
            }
          for (long i = 0; i < block; i += 16) acc += *reinterpret_cast<const Vec16*>(kb + i);
          for (long i = 0; i < block; i += 16) acc += *reinterpret_cast<const Vec16*>(vb + i);
        }
        for (int i = 0; i < 16; ++i) sink += acc[i];
      }
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  printf("%.1f %d\n", layers * blocks * block * 8 / best / 1e9, sink != 0.0f);
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per sequence (64 x 16 = 1,024 tokens)")
    parser.add_argument("--layers", type=int, default=4, help="distinct caches read in turn (beyond the caches)")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    args = parser.parse_args()
    threads = args.threads
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        sys.exit("no C++ compiler found (set CXX)")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "kv_read.cpp", Path(tmp) / "kv_read"
        source.write_text(SOURCE)
        subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", str(source), "-o", str(binary)], check=True)
        megabytes = args.layers * args.seqs * args.blocks * 16 * 3 * 64 * 4 * 2 / 2**20
        print(f"{args.seqs} sequences x {args.blocks} blocks of 12 KiB (K and V), {args.layers} layers "
              f"({megabytes:,.0f} MiB in all), {threads} threads, best of 10:")
        for shuffled in (0, 1):
            for lines in (0, 4):
                out = subprocess.run([str(binary), str(args.seqs), str(args.blocks), str(args.layers), str(threads),
                                      str(shuffled), str(lines)], check=True, capture_output=True, text=True)
                print(f"  {'shuffled' if shuffled else 'consecutive':>11} blocks, prefetch {lines} lines of the next: "
                      f"{float(out.stdout.split()[0]):6.1f} GB/s")


if __name__ == "__main__":
    main()
