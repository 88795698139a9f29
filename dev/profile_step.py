"""Where does a step's time go? Runs a workload through the engine with timers around each stage of the step and
a torch profiler over a few decode steps. The timers wrap the engine's internals (that is what they measure);
the engine itself is driven through its public API.
Usage: python dev/profile_step.py [--rows 64] [--max-tokens 48] [--workload labeling|generation|mixed]
(without --workload: chat prompts of 40-300 words, each generating exactly --max-tokens tokens)."""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict


from batchgen.engine import Engine, EngineArgs, Request, SamplingParams

WORDS = ("the data model batch token cache prefix engine python label review summary quality customer order "
         "shipping refund product weather river mountain history science music garden kitchen").split()


def prompts(tokenizer, rows, seed, lo, hi):
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": "Write about: " + text}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-words", type=int, default=40)
    ap.add_argument("--max-words", type=int, default=300)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--workload", choices=["labeling", "generation", "mixed"], help="a `batchgen bench` workload")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--torch-profile-run", action="store_true", help="torch's operator table over the whole run")
    args = ap.parse_args()
    engine = Engine(EngineArgs(model="default", dtype=args.dtype, max_num_seqs=args.max_num_seqs))
    timers = defaultdict(float)
    counts = defaultdict(int)

    def timed(obj, name, key):
        original = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                timers[key] += time.perf_counter() - t
                counts[key] += 1
        setattr(obj, name, wrapper)

    runner = engine.runner
    timed(engine.scheduler, "schedule", "schedule")
    timed(runner, "_prepare", "prepare inputs")
    timed(runner.model, "forward", "model forward")
    timed(runner.model, "compute_logits", "lm_head")
    timed(runner.sampler.__class__, "__call__", "sampler")
    timed(engine, "step", "whole step")
    import batchgen_kernels.reference as ref
    timed(ref, "paged_attention", "attention (kernel)")
    timed(ref, "paged_decode", "  decode attention")
    timed(ref, "paged_prefill", "  prefill attention")
    timed(ref, "store_kv", "store kv")

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if args.workload:
        from batchgen.bench.workloads import synthetic_workload
        bench_rows = sorted(synthetic_workload(args.workload, args.rows, 0, engine.tokenizer).rows,
                            key=lambda row: row.token_ids)
        requests = [Request(row.id, row.token_ids, SamplingParams(max_tokens=row.max_tokens, temperature=0.0))
                    for row in bench_rows]
        rows = [row.token_ids for row in bench_rows]
    else:
        rows = prompts(engine.tokenizer, args.rows, 0, args.min_words, args.max_words)
        requests = [Request(i, p, params) for i, p in enumerate(rows)]
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile
    profiler = profile(activities=[ProfilerActivity.CPU]) if args.torch_profile_run else nullcontext()
    t = time.perf_counter()
    with profiler:
        results = list(engine.generate(requests))
    wall = time.perf_counter() - t
    out_tokens = sum(r.output_tokens for r in results)
    print(f"rows {len(results)}  prompt tokens {sum(r.prompt_tokens for r in results)}  output tokens {out_tokens}  "
          f"steps {engine.num_steps}  wall {wall:.2f}s  output tok/s {out_tokens / wall:.1f}")
    for key, value in sorted(timers.items(), key=lambda kv: -kv[1]):
        print(f"  {key:20s} {value:8.2f}s  {100 * value / wall:5.1f}%  calls {counts[key]}")
    if args.torch_profile_run:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if args.torch_profile:
        for i, p in enumerate(rows):  # a fresh batch: run its prefills, then profile pure decode steps
            engine.add_request(Request(10_000 + i, p, params))
        engine.step()
        while engine.last_step.num_prefill_tokens:
            engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
