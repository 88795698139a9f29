"""Where a prefill's time goes, by operator and input shape: ROWS random prompts of TOKENS tokens through the engine
(max_tokens 1), once to warm up, once timed, once under torch's profiler. Behind the README's "At 1B" arithmetic
(the Linear layers' rate inside the engine against the machine's matmul ceiling).

    python dev/profile_prefill.py --model ~/.cache/batchgen/random-models/llama-1b-bfloat16 --dtype float32
"""
from __future__ import annotations

import argparse
import random
import time

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=226)
    args = parser.parse_args()
    engine = Engine(EngineArgs(model=args.model, device="cpu", dtype=args.dtype, kv_cache_memory="2GiB"))
    rng = random.Random(0)

    def requests(base: int) -> list[Request]:  # fresh tokens each time (no prefix-cache hits), ids of the default
        # model's tokenizer, which dev/make_random_model.py gives its models
        return [Request(base + i, [rng.randint(100, 49000) for _ in range(args.tokens)],
                        SamplingParams(max_tokens=1, ignore_eos=True)) for i in range(args.rows)]

    list(engine.generate(requests(0)))
    start = time.perf_counter()
    list(engine.generate(requests(1000)))
    print(f"{args.rows} x {args.tokens} prompt tokens: {time.perf_counter() - start:.2f} s")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        list(engine.generate(requests(2000)))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12,
                                                             max_name_column_width=30, max_shapes_column_width=80))


if __name__ == "__main__":
    main()
