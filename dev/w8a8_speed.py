"""W8A8's speed with each activations choice against bf16, in one process: the labeling job's prompts (prefill-heavy:
4 tokens a row) and the same rows decoding 64 tokens each, greedy, through the engine's request API (no job, no
quality gate: dev/w8a8_figures.py measures those). The static scales and smoothing factors come from one unquantized
pass over --calib-rows rows (engine/calibration.measure without its per-layer sensitivities); o_proj and the LM head
stay in bf16 (quantization.DEFAULT_KEEP). Best of --repeats, interleaved.

    PYTHONPATH=$PWD:$PWD/kernels flock -x /tmp/cpu.lock python dev/w8a8_speed.py \\
        --model ~/.cache/batchgen/random-models/llama-1b-bfloat16
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.calibration import measure, quantizable_layers
from batchgen.models.loader import reference_model_dir
from batchgen.models.quantization import DEFAULT_KEEP, is_kept


def prompts(tokenizer) -> list[list[int]]:
    job = yaml.safe_load(Path("jobs/labeling.yaml").read_text())["input"]
    table = pq.read_table("data/samples/labeling.parquet").to_pylist()
    return [tokenizer.encode(job["system_prompt"] + job["template"].format(**row)) for row in table]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--calib-rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=40, help="the labeling job's first rows timed")
    args = parser.parse_args()
    model = str(reference_model_dir(args.model)) if args.model == "default" else str(Path(args.model).expanduser())
    base = dict(model=model, dtype="bfloat16", kv_cache_memory="1GiB", max_num_seqs=40)
    engine = Engine(EngineArgs(**base, enable_prefix_caching=False))
    rows = prompts(engine.tokenizer)[:args.rows]
    layers = [n for n in quantizable_layers(engine.model) if not is_kept(n, DEFAULT_KEEP)]
    calib = rows[:: max(1, len(rows) // args.calib_rows)][:args.calib_rows]
    scales = {choice: measure(engine, calib, layers, choice, sensitivities=False).scales
              for choice in ("static", "smooth")}
    del engine
    gc.collect()
    int8 = dict(quantization="int8", quantization_keep=DEFAULT_KEEP)
    variants = {"bf16": {}, "int8 dynamic": int8, "int8 static": {**int8, "quantization_scales": scales["static"]},
                "int8 smooth": {**int8, "quantization_scales": scales["smooth"]}}
    workloads = {"labeling (4 tokens)": SamplingParams(max_tokens=4, temperature=0.0),
                 f"decode ({args.decode_tokens} tokens)": SamplingParams(max_tokens=args.decode_tokens,
                                                                         temperature=0.0, ignore_eos=True)}
    best = {}
    for name, changes in variants.items():
        engine = Engine(EngineArgs(**base, **changes))
        for workload, params in workloads.items():
            list(engine.generate(Request(("warm", i), ids, params) for i, ids in enumerate(rows[:2])))
            for r in range(args.repeats):
                started = time.perf_counter()
                list(engine.generate(Request((r, i), ids, params) for i, ids in enumerate(rows)))
                took = time.perf_counter() - started
                best[(name, workload)] = min(best.get((name, workload), float("inf")), took)
        del engine
        gc.collect()
    print(f"| variant | {' | '.join(workloads)} |\n|---|" + "---:|" * len(workloads))
    for name in variants:
        cells = [f"{best[(name, w)]:.2f} s ({best[('bf16', w)] / best[(name, w)]:.2f}x bf16)" for w in workloads]
        print(f"| {name} | {' | '.join(cells)} |")
    print(json.dumps({f"{n} / {w}": round(t, 3) for (n, w), t in best.items()}))


if __name__ == "__main__":
    main()
