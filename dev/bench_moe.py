"""A MoE model against the dense model of the same active size, through the engine's public API (EngineArgs, Engine,
add_request, step): the time of one prefill step and of one decode step at each batch, both engines loaded in this
one process and run in turn, case by case and repetition by repetition, so that load from other processes on a
shared machine falls on both alike. Prints each case's median over the repetitions and MoE / dense.

    PYTHONPATH=$PWD:$PWD/kernels python dev/make_random_model.py --shape llama-1b --out ~/moe-bench/llama-1b
    PYTHONPATH=$PWD:$PWD/kernels python dev/make_random_model.py --shape moe-1b-16x2 --out ~/moe-bench/moe-1b-16x2
    PYTHONPATH=$PWD:$PWD/kernels python dev/bench_moe.py --dense ~/moe-bench/llama-1b --moe ~/moe-bench/moe-1b-16x2

A decode case: `batch` fresh prompts of --decode-prompt tokens prefilled in one step (not timed), then --decode-steps
steps of `batch` decodes, each timed. The prefill case: --prefill SEQSxTOKENS fresh prompts in one step, one token
each. Prompts are random token ids (prefix caching off), greedy, EOS ignored.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams


def timed_steps(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Each step's seconds until every request has finished (the first step: all prompts' prefill)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{time.monotonic_ns()}-{i}", prompt, params))
    times = []
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dense", required=True)
    parser.add_argument("--moe", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--decode-prompt", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=6)
    parser.add_argument("--prefill", default="2x256")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    seqs, length = (int(n) for n in args.prefill.split("x"))
    step_tokens = max(seqs * length, max(batches) * args.decode_prompt)
    engines = {}
    for name, path in (("dense", args.dense), ("moe", args.moe)):
        started = time.perf_counter()
        engines[name] = Engine(EngineArgs(model=path, dtype=args.dtype, device="cpu", kv_cache_memory="512MiB",
                                          max_num_seqs=max(batches + [seqs]), max_num_batched_tokens=step_tokens,
                                          enable_prefix_caching=False))
        print(f"{name}: {path} loaded in {time.perf_counter() - started:.1f} s", flush=True)
    vocab = min(engine.vocab_size for engine in engines.values())
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    cases = [("prefill", f"{seqs}x{length}")] + [("decode", f"B={b}") for b in batches]
    medians: dict[tuple[str, str, str], list[float]] = {}
    for rep in range(args.reps + 1):  # the first repetition warms up (kernels built, memory touched)
        loads = os.getloadavg()[0]
        for kind, label in cases:
            order = ("dense", "moe") if rep % 2 == 0 else ("moe", "dense")
            for name in order:
                if kind == "prefill":
                    seconds = timed_steps(engines[name], [prompt(length) for _ in range(seqs)], 1)[0]
                else:
                    batch = int(label[2:])
                    steps = timed_steps(engines[name], [prompt(args.decode_prompt) for _ in range(batch)],
                                        1 + args.decode_steps)
                    seconds = statistics.median(steps[1:])
                if rep:
                    medians.setdefault((kind, label, name), []).append(seconds)
        print(f"repetition {rep}{' (warm-up)' if not rep else ''} done, load average {loads:.2f} -> "
              f"{os.getloadavg()[0]:.2f}", flush=True)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; medians of {args.reps} "
          f"repetitions (a decode case: the median step of each)")
    print(f"{'case':<16}{'dense ms':>10}{'MoE ms':>10}{'MoE/dense':>11}   dense tok/s   MoE tok/s")
    for kind, label in cases:
        dense = statistics.median(medians[(kind, label, "dense")])
        moe = statistics.median(medians[(kind, label, "moe")])
        tokens = seqs * length if kind == "prefill" else int(label[2:])
        print(f"{kind + ' ' + label:<16}{dense * 1e3:>10,.1f}{moe * 1e3:>10,.1f}{moe / dense:>10.2f}x"
              f"{tokens / dense:>14,.1f}{tokens / moe:>12,.1f}")


if __name__ == "__main__":
    main()
