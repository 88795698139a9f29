"""engine.kv_cache_dtype: int8 against the model's dtype (issue 43), in one process, both KV caches side by side:

- decode: one engine decode step of BATCH sequences of CONTEXT tokens each (the KV cache random, each sequence on its
  own blocks: bench/roofline.py's synthetic step, no prefill needed), best and median of REPS after 2 warm-ups;
- labeling: the bench's labeling workload (`batchgen bench --workload labeling`: ROWS rows, one shared system prompt,
  8 output tokens) through the engine's API, greedy, then answered by `choice` scoring over the bench's labels:
  generation time, and how many rows (free greedy) and labels (choice) the int8 cache gives as the model's does,
  with how near a tie each parting was in the model-dtype run (`agreement`).

Prints one JSON record and appends it to --archive (docs/performance-archive.jsonl) with the machine's CPU flags.
Run it on a quiet machine, from the checkout's root:

  PYTHONPATH=$PWD:$PWD/kernels flock -x /tmp/cpu.lock python dev/bench_kv_int8.py --parts decode,labeling
  PYTHONPATH=$PWD:$PWD/kernels python dev/bench_kv_int8.py --model ~/.cache/batchgen/random-models/llama-1b-bfloat16
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

KV_DTYPES = ("auto", "int8")
NEAR_TIE = 0.25  # nats between the base run's top two tokens: two steps of bf16 logits between 16 and 32
NEAR_TIE_LABEL = 0.05  # probability between the base run's top two labels


def decode_case(model: str, dtype: str, kv_cache_dtype: str, batch: int, context: int, reps: int) -> dict:
    from batchgen.bench.roofline import synthetic_sequences, time_step
    from batchgen.engine import EngineArgs
    from batchgen.engine.engine_plan import kv_bytes_per_token
    from batchgen.engine.startup import set_up
    from batchgen.models.inspector import describe_model
    from batchgen.models.loader import resolve_model

    block_size = EngineArgs.block_size
    blocks = batch * -(-context // block_size)
    per_token = kv_bytes_per_token(describe_model(resolve_model(model)),
                                   torch.int8 if kv_cache_dtype == "int8" else getattr(torch, dtype))
    setup = set_up(EngineArgs(model=model, dtype=dtype, device="cpu", enable_prefix_caching=False,
                              kv_cache_memory=(blocks + 1) * block_size * per_token, kv_cache_dtype=kv_cache_dtype,
                              max_model_len=context + 1, max_num_seqs=batch))
    runner = setup.runner
    if runner.kv.scales is None:
        runner.kv.tensor.uniform_(-1.0, 1.0)
    else:  # int8 values and scales of about the same spread
        runner.kv.tensor.random_(-127, 128)
        runner.kv.scales.uniform_(0.5 / 127, 1.0 / 127)
    seqs = synthetic_sequences(batch, context, context - 1, block_size, setup.model.vocab_size,
                               np.random.default_rng(0))
    timed = time_step(runner, {seq: 1 for seq in seqs}, 2, reps)
    result = {"kv_cache_dtype": kv_cache_dtype, "kv_bytes_per_token": setup.plan.kv_bytes_per_token,
              "kv_cache_bytes": setup.plan.kv_pool.bytes, "best_ms": timed.best_s * 1e3,
              "median_ms": timed.median_s * 1e3}
    del setup, runner
    gc.collect()
    return result


def labeling_case(model: str, dtype: str, kv_cache_dtype: str, rows: int, seed: int) -> dict:
    from batchgen.bench.workloads import LABELING_LABELS, synthetic_workload
    from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
    from batchgen.job.input.source import sort_windows

    engine = Engine(EngineArgs(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype))
    workload = synthetic_workload("labeling", rows, seed, engine.tokenizer, model)
    ordered = list(sort_windows(workload.rows, window=rows + 1, how="prefix"))  # as the bench and `batchgen run`
    started = time.monotonic()
    results = list(engine.generate(Request(row.id, row.token_ids, SamplingParams(
        max_tokens=row.max_tokens, temperature=0.0, logprobs=2)) for row in ordered))
    wall_s = time.monotonic() - started
    free = {r.request_id: list(r.token_ids) for r in results}
    gaps = {r.request_id: [top[0][2] - top[1][2] for top in r.top_logprobs] for r in results}  # top-1 - top-2 logprob
    started = time.monotonic()
    probs = {r.request_id: sorted(r.choice_probs, key=lambda c: -c[1]) for r in engine.generate(
        Request(row.id, row.token_ids, SamplingParams(max_tokens=row.max_tokens, temperature=0.0,
                                                      choice=LABELING_LABELS)) for row in ordered)}
    choice_s = time.monotonic() - started
    tokens = sum(len(ids) for ids in free.values())
    return {"kv_cache_dtype": kv_cache_dtype, "kv_bytes_per_token": engine.plan.kv_bytes_per_token,
            "generation_s": wall_s, "output_tokens": tokens, "choice_s": choice_s, "free": free, "gaps": gaps,
            "labels": {i: p[0][0] for i, p in probs.items()}, "margins": {i: p[0][1] - p[1][1] for i, p in probs.items()}}


def agreement(base: dict, other: dict) -> dict:
    """How many rows and labels the int8 cache gives as the base does, and how close to a tie each parting was in the
    base run: its top-two logprob gap at a row's first differing token, its top-two label probability margin. A row
    is decided when no token of it (in the base run) had a gap under NEAR_TIE nats; a label when its margin is at
    least NEAR_TIE_LABEL."""
    ids = list(base["free"])
    same = {i: base["free"][i] == other["free"][i] for i in ids}
    parting = sorted(base["gaps"][i][next(p for p, (a, b) in enumerate(zip(base["free"][i], other["free"][i]))
                                          if a != b)] for i in ids if not same[i])
    decided = [i for i in ids if min(base["gaps"][i], default=float("inf")) >= NEAR_TIE]
    labels = {i: base["labels"][i] == other["labels"][i] for i in base["labels"]}
    decided_labels = [i for i in labels if base["margins"][i] >= NEAR_TIE_LABEL]
    return {"identical_rows": sum(same.values()), "rows": len(ids), "identical_share": sum(same.values()) / len(ids),
            "same_labels": sum(labels.values()), "label_share": sum(labels.values()) / len(labels),
            "parting_gaps": [round(g, 4) for g in parting],
            "flipped_label_margins": sorted(round(base["margins"][i], 4) for i in labels if not labels[i]),
            "near_tie_nats": NEAR_TIE, "decided_rows": len(decided),
            "decided_identical": sum(same[i] for i in decided),
            "near_tie_label_margin": NEAR_TIE_LABEL, "decided_labels": len(decided_labels),
            "decided_same_labels": sum(labels[i] for i in decided_labels)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--float-weights", action="store_true", help="a named or GGUF model's weights dequantized "
                        "(the reference checkpoint: no int8 matmuls, whose activation rounding hides the cache's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--parts", default="decode,labeling")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--archive", default="docs/performance-archive.jsonl")
    args = parser.parse_args()
    if args.float_weights:
        from batchgen.models.loader import reference_model_dir
        args.model = str(reference_model_dir(args.model))
    from batchgen.bench.checkout import git_commit
    from batchgen.machine import machine_info

    record = {"kind": "kv-int8", "date": datetime.now(timezone.utc).isoformat(), "git_commit": git_commit(),
              "machine": machine_info(), "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads()}
    parts = args.parts.split(",")
    if "decode" in parts:
        cases = [decode_case(args.model, args.dtype, kv, args.batch, args.context, args.reps) for kv in KV_DTYPES]
        record["decode"] = {"batch": args.batch, "context": args.context, "cases": cases,
                            "int8_speedup": cases[0]["best_ms"] / cases[1]["best_ms"]}
    if "labeling" in parts:
        runs = [labeling_case(args.model, args.dtype, kv, args.rows, args.seed) for kv in KV_DTYPES]
        record["labeling"] = {"rows": args.rows, "agreement": agreement(*runs),
                              "cases": [{k: v for k, v in run.items() if k not in ("free", "gaps", "labels", "margins")}
                                        for run in runs]}
    print(json.dumps(record, indent=1))
    if args.archive:
        with open(Path(args.archive), "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
