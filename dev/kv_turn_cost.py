"""What turning q and k over an int8 KV cache costs a decode step (batchgen/models/attention.py, `Attention.turned`):
one engine decode step of BATCH sequences of CONTEXT tokens over an int8 cache (random, no prefill: bench/roofline.py's
synthetic step), with the turn on and off in one process, alternated ROUNDS times, best and median of REPS each.
Switching it off changes the scores' rounding, not the step's work otherwise: a timing, not a run to read outputs of.

  PYTHONPATH=$PWD:$PWD/kernels flock -x /tmp/cpu.lock python dev/kv_turn_cost.py --batch 32 --context 512
"""
from __future__ import annotations

import argparse

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from batchgen.bench.roofline import synthetic_sequences, time_step
    from batchgen.engine import EngineArgs
    from batchgen.engine.engine_plan import kv_bytes_per_token
    from batchgen.engine.startup import set_up
    from batchgen.models.attention import Attention
    from batchgen.models.inspector import describe_model
    from batchgen.models.loader import resolve_model

    block_size = EngineArgs.block_size
    blocks = args.batch * -(-args.context // block_size)
    per_token = kv_bytes_per_token(describe_model(resolve_model(args.model)), torch.int8)
    setup = set_up(EngineArgs(model=args.model, dtype=args.dtype, device="cpu", enable_prefix_caching=False,
                              kv_cache_memory=(blocks + 1) * block_size * per_token, kv_cache_dtype="int8",
                              max_model_len=args.context + 1, max_num_seqs=args.batch))
    runner = setup.runner
    runner.kv.tensor.random_(-127, 128)
    runner.kv.scales.uniform_(0.5 / 127, 1.0 / 127)
    seqs = synthetic_sequences(args.batch, args.context, args.context - 1, block_size, setup.model.vocab_size,
                               np.random.default_rng(0))
    layers = [m for m in setup.model.modules() if isinstance(m, Attention)]
    turns = [layer.rotation for layer in layers]
    for _ in range(args.rounds):
        for on in (True, False):
            for layer, turn in zip(layers, turns):
                layer.rotation = turn if on else None
            timed = time_step(runner, {seq: 1 for seq in seqs}, 2, args.reps)
            print(f"{'turned  ' if on else 'unturned'} best {timed.best_s * 1e3:.2f} ms, "
                  f"median {timed.median_s * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
