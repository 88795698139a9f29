"""One engine's step times through its public request API: SEQS random prompts of PROMPT tokens, TOKENS greedy tokens
each (EOS ignored), every step timed; prints the total, the first two steps (the prefill) and the median decode step.
Behind docs/models.md "The generic path" (its cost against the native path).

    PYTHONPATH=$PWD:$PWD/kernels SEQS=16 PROMPT=64 TOKENS=16 python dev/engine_steps.py MODEL_DIR native
    PYTHONPATH=$PWD:$PWD/kernels SEQS=16 PROMPT=64 TOKENS=16 python dev/engine_steps.py MODEL_DIR transformers
"""
import argparse
import os
import random
import statistics
import time

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model directory")
    parser.add_argument("impl", choices=["auto", "native", "transformers"], help="engine.model_impl")
    args = parser.parse_args()
    model, impl = args.model, args.impl
    seqs, prompt, tokens = (int(os.environ.get(k, d)) for k, d in (("SEQS", 16), ("PROMPT", 200), ("TOKENS", 40)))
    engine = Engine(EngineArgs(model=model, dtype="bfloat16", model_impl=impl, max_num_seqs=seqs,
                               kv_cache_memory="1GiB"))
    rng = random.Random(0)
    for i in range(seqs):
        engine.add_request(Request(i, [rng.randrange(100, 30000) for _ in range(prompt)],
                                   SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
    started, steps = time.perf_counter(), []
    while engine.has_unfinished():
        step_started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - step_started)
    print(f"{impl}: total {time.perf_counter() - started:.2f} s, first two steps {sum(steps[:2]):.2f} s, "
          f"decode step median {statistics.median(steps[3:]) * 1e3:.1f} ms, {len(steps)} steps")


if __name__ == "__main__":
    main()
