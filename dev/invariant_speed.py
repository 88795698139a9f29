"""engine.batch_invariant's cost in one process: the same rows with it off and on, through the engine's request API,
greedy: the labeling job's prompts (prefill-heavy: 4 tokens a row) and the same rows decoding --decode-tokens tokens.
Best of --repeats, interleaved per engine. Also prints which kernel the packed Linear layers run on (oneDNN, or in
batch-invariant bf16 on AMX the AMX Linear's tiles: models/packed_linear.py).

    PYTHONPATH=$PWD:$PWD/kernels flock -x /tmp/cpu.lock python dev/invariant_speed.py \\
        --model ~/.cache/batchgen/random-models/llama-1b-bfloat16 --rows 32
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import time
from pathlib import Path

from w8a8_speed import prompts  # the labeling job's prompts (this script's folder is on sys.path)

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.models.loader import reference_model_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=32, help="the labeling job's first rows timed")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = str(reference_model_dir(args.model)) if args.model == "default" else str(Path(args.model).expanduser())
    workloads = {"labeling (4 tokens)": SamplingParams(max_tokens=4, temperature=0.0),
                 f"decode ({args.decode_tokens} tokens)": SamplingParams(max_tokens=args.decode_tokens,
                                                                         temperature=0.0, ignore_eos=True)}
    best, load = {}, {}
    for invariant in (False, True):
        started = time.perf_counter()
        engine = Engine(EngineArgs(model=model, dtype=args.dtype, kv_cache_memory="1GiB", max_num_seqs=args.rows,
                                   batch_invariant=invariant))
        load[invariant] = time.perf_counter() - started
        kernels = collections.Counter(f"{type(m).__name__}/{getattr(m, 'kernel', '-')}" for m in engine.model.modules()
                                      if type(m).__name__.endswith("Linear"))
        print(f"batch_invariant {invariant}: load {load[invariant]:.1f} s, {dict(kernels)}", flush=True)
        rows = prompts(engine.tokenizer)[:args.rows]
        for workload, params in workloads.items():
            list(engine.generate(Request(("warm", i), ids, params) for i, ids in enumerate(rows[:2])))
            for r in range(args.repeats):
                started = time.perf_counter()
                list(engine.generate(Request((r, i), ids, params) for i, ids in enumerate(rows)))
                best[(invariant, workload)] = min(best.get((invariant, workload), float("inf")),
                                                  time.perf_counter() - started)
        del engine
        gc.collect()
    print(f"| batch_invariant | {' | '.join(workloads)} |\n|---|" + "---:|" * len(workloads))
    for invariant in (False, True):
        cells = [f"{best[(invariant, w)]:.2f} s ({best[(invariant, w)] / best[(False, w)]:.2f}x off)" for w in workloads]
        print(f"| {'on' if invariant else 'off'} | {' | '.join(cells)} |")
    print(json.dumps({f"{'on' if i else 'off'} / {w}": round(t, 3) for (i, w), t in best.items()}))


if __name__ == "__main__":
    main()
