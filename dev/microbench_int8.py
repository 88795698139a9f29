"""int8 against bf16 and fp32: the default model's matmul shapes at decode-sized row counts, and one end-to-end run.

    PYTHONPATH=$PWD:$PWD/kernels python dev/microbench_int8.py [--skip-matmuls] [--skip-engine]
    PYTHONPATH=$PWD:$PWD/kernels python dev/microbench_int8.py --gemm-paths [--shape 1b]

--gemm-paths: the int8 GEMM paths W8A8 can take (models/int8_activations.py) against bf16's oneDNN (AMX) Linear,
each with its activations' quantization and rescale included: torch._int_mm with a separate fp32 rescale, per-token
(dynamic) and per-tensor (static) scales, and oneDNN's quantized linear (onednn.qlinear_pointwise, prepacked weight)
with dynamic and static scales. Times are ratios to bf16's (below 1: faster).

Every figure is the best of N interleaved repetitions, as a ratio to fp32 measured in the same process (the machine
is shared: absolute times are noise, ratios less so). The int8 paths are models/quantization.py's Int8Linear:
`dynamic_int8` (what quantization: int8 runs on the CPU) and `weight_only` (aten._weight_int8pack_mm).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from batchgen.models.int8_activations import int_mm_matmul, onednn_int8_matmul, pack
from batchgen.models.packed_linear import PackedLinear
from batchgen.models.quantization import Int8Linear, quantize_weight

# (in, out) of the default model's (SmolLM2-135M) Linear layers
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
ROWS = (1, 8, 32, 64, 256)
# (in, out) of the 1B Llama shape's (dev/make_random_model.py) Linear layers, and the rows the GEMM paths are timed at
SHAPES_1B = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}
GEMM_ROWS = (1, 8, 32, 256, 512)


def best_of(fns: dict, repeats: int) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@torch.inference_mode()
def matmuls(repeats: int) -> None:
    torch.manual_seed(0)
    print("| layer | rows | fp32 µs | bf16 | int8 W8A8, fp32 in | int8 W8A8, bf16 in | int8 weight-only, bf16 in |"
          " int8 weight-only, fp32 in |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (k, n) in SHAPES.items():
        linear = nn.Linear(k, n, bias=False)
        bf16 = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        bf16.weight.copy_(linear.weight)
        w8a8 = Int8Linear.from_linear(linear)
        weight_only = Int8Linear.from_linear(bf16, "weight_only")
        weight_only32 = Int8Linear.from_linear(linear, "weight_only")
        for m in ROWS:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            fns = {"fp32": lambda: linear(x), "bf16": lambda: bf16(xb), "w8a8": lambda: w8a8(x),
                   "w8a8_bf16": lambda: w8a8(xb), "wo_bf16": lambda: weight_only(xb)}
            if m <= 8:  # fp32 activations have no vectorised weight-only kernel: 6-35x slower, only shown small
                fns["wo_fp32"] = lambda: weight_only32(x)
            reps = max(3, repeats // (4 if name == "lm_head" else 1))
            t = best_of(fns, reps)
            ratio = lambda key: f"{t[key] / t['fp32']:.2f}x" if key in t else "-"
            print(f"| {name} {k}->{n} | {m} | {t['fp32'] * 1e6:,.0f} | {ratio('bf16')} | {ratio('w8a8')} | "
                  f"{ratio('w8a8_bf16')} | {ratio('wo_bf16')} | {ratio('wo_fp32')} |", flush=True)


@torch.inference_mode()
def gemm_paths(shapes: dict, repeats: int) -> None:
    torch.manual_seed(0)
    print("| layer | rows | bf16 µs | _int_mm dynamic | _int_mm static | oneDNN dynamic | oneDNN static |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (k, n) in shapes.items():
        weight = torch.randn(n, k) * 0.02
        bf16 = PackedLinear(weight.bfloat16(), None)
        q, scale = quantize_weight(weight)
        packed = pack(q)
        for m in GEMM_ROWS:
            x = torch.randn(m, k).bfloat16()
            static = float(x.float().abs().max()) / 127.0
            fns = {"bf16": lambda: bf16(x), "mm_dyn": lambda: int_mm_matmul(x, q, scale, None, None),
                   "mm_static": lambda: int_mm_matmul(x, q, scale, None, static),
                   "dnn_dyn": lambda: onednn_int8_matmul(x, packed, scale, None, None),
                   "dnn_static": lambda: onednn_int8_matmul(x, packed, scale, None, static)}
            t = best_of(fns, repeats)
            print(f"| {name} {k}->{n} | {m} | {t['bf16'] * 1e6:,.0f} | " +
                  " | ".join(f"{t[key] / t['bf16']:.2f}x" for key in list(fns)[1:]) + " |", flush=True)


def engine_run(rows: int, max_tokens: int, repeats: int) -> None:
    from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
    from batchgen.models.accounting import weight_bytes
    from quant_quality import prompts  # dev/quant_quality.py, beside this file

    configs = {"fp32": ("float32", None), "fp32 + int8": ("float32", "int8"),
               "bf16": ("bfloat16", None), "bf16 + int8": ("bfloat16", "int8")}
    # no prefix caching: every repetition computes the prompts again
    engines = {name: Engine(EngineArgs(dtype=dtype, quantization=q, kv_cache_memory="512MiB",
                                       enable_prefix_caching=False))
               for name, (dtype, q) in configs.items()}
    questions = prompts(next(iter(engines.values())).tokenizer, 2 * rows)[rows:]  # the question half
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def run(engine):
        return lambda: list(engine.generate(Request(i, ids, params) for i, ids in enumerate(questions)))

    t = best_of({name: run(engine) for name, engine in engines.items()}, repeats)
    lengths = sorted(len(q) for q in questions)
    print(f"\n{rows} rows ({lengths[0]}-{lengths[-1]} prompt tokens), greedy, {max_tokens} tokens each, "
          f"best of {repeats}:")
    print("| engine | weights MiB | seconds | output tok/s | vs fp32 |")
    print("|---|---:|---:|---:|---:|")
    for name, engine in engines.items():
        print(f"| {name} | {weight_bytes(engine.model) / 2**20:,.0f} | {t[name]:.2f} | "
              f"{rows * max_tokens / t[name]:,.1f} | {t['fp32'] / t[name]:.2f}x faster |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-matmuls", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--engine-repeats", type=int, default=3)
    parser.add_argument("--gemm-paths", action="store_true", help="only the int8 GEMM paths against bf16")
    parser.add_argument("--shape", choices=("135m", "1b"), default="1b", help="--gemm-paths' Linear shapes")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if args.gemm_paths:
        gemm_paths(SHAPES_1B if args.shape == "1b" else SHAPES, args.repeats)
        return
    if not args.skip_matmuls:
        matmuls(args.repeats)
    if not args.skip_engine:
        engine_run(args.rows, args.max_tokens, args.engine_repeats)


if __name__ == "__main__":
    main()
