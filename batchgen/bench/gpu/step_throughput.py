"""Step 3: speed. The device's copy bandwidth and bf16 matmul rate; output tokens/s of batchgen on a synthetic
offline workload (random prompts, ignore_eos) against transformers' `generate` with static batching (rows sorted by
length, left-padded) on a random subset of it; and whole decode steps at a few batch sizes against their floor:
max(bytes read per step (weights + the batch's KV) / copy bandwidth, FLOPs per step / matmul rate). The speed bars
(issue 5's: 10x transformers, decode within 1.5x of its floor) are reported in `targets`, not gated. And the int8
KV cache's kernels against the torch reference, and their decode time against the bf16 cache's (kv_int8.py)."""
from __future__ import annotations

import random

import torch

from .batchgen_side import batchgen_throughput, decode_step_times, open_engine
from .device import copy_bandwidth, free_device_memory, matmul_rate
from .kv_int8 import kv_int8_case
from .shapes import MODEL_CONFIGS, ModelShape, describe_model
from .transformers_side import bf16_model_and_checkpoint, checkpoint_dir, hf_static_throughput
from ..workloads import random_token_rows

# Shares of the step's budget left when each timed run starts (the rest: the engine's start, the decode steps).
HF_SHARE, BATCHGEN_SHARE = 0.3, 0.5
DECODE_MIN_S = 10.0  # of the step's budget, left for one decode batch size to start


def measure_rates(device: torch.device) -> dict:
    small = device.type != "cuda"  # a dry run: the CPU, quickly
    return {"copy_bandwidth_bytes_per_s": copy_bandwidth(device, nbytes=2**26 if small else 2 * 2**30),
            "bf16_matmul_flops_per_s": matmul_rate(device, n=512 if small else 8192)}


def targets(record: dict) -> dict:
    """Issue 5's bars: output tokens/s at least 10x transformers' static batching; decode step time within 1.5x of
    its floor."""
    ours = (record.get("batchgen") or {}).get("output_tokens_per_s")
    theirs = (record.get("hf_static") or {}).get("output_tokens_per_s")
    speedup = ours / theirs if ours and theirs else None
    return {"speedup_vs_hf_static": speedup, "speedup_at_least_10x": speedup is not None and speedup >= 10,
            "decode_within_1.5x_of_floor": {size: d["ratio_to_floor"] <= 1.5
                                            for size, d in record.get("decode", {}).items() if "ratio_to_floor" in d}}


def run_throughput(args, record) -> bool:
    device = torch.device(args.device)
    config = MODEL_CONFIGS[args.model]
    shape = ModelShape.from_config(config)
    record["model"] = describe_model(args.model)
    workload = random_token_rows(args.requests, (args.prompt_min, args.prompt_max),
                                 (args.output_min, args.output_max), shape.vocab, args.seed)
    hf_subset = random.Random(args.seed + 1).sample(workload, min(args.hf_requests, len(workload)))
    rates = record.phase("rates", lambda: measure_rates(device))
    free_device_memory()
    kv_int8 = record.phase("kv_int8", lambda: kv_int8_case(shape, device, args.attention_backend, args.seed))
    free_device_memory()

    # transformers first, then batchgen: never both models on the device at once.
    hf = record.phase("hf_model", lambda: bf16_model_and_checkpoint(config, checkpoint_dir(args), device, args.seed),
                      keep=False)
    if hf is not None:
        record.phase("hf_static", lambda: hf_static_throughput(
            hf, hf_subset, args.hf_batch_size, min(args.hf_time_limit, HF_SHARE * record.seconds_left())))
    hf = None  # freed before the engine loads
    free_device_memory()

    opened = record.phase("engine_load", lambda: open_engine(checkpoint_dir(args), "bfloat16", args), keep=False)
    if opened is not None:
        engine, record["engine_load"] = opened
        del opened
        record.phase("batchgen", lambda: batchgen_throughput(
            engine, workload, min(args.time_limit, BATCHGEN_SHARE * record.seconds_left())))
        record.setdefault("decode", {})
        for size in (b for b in args.decode_batch_sizes if b <= args.max_num_seqs):
            record.phase(str(size), lambda b=size: decode_step_times(
                engine, shape, b, args.decode_context, args.decode_steps, rates, args.seed),
                group="decode", min_s=DECODE_MIN_S)
        engine = None
        free_device_memory()
    record["targets"] = targets(record)
    # Figures, not verdicts (the step fails where a phase raised), but for the int8 kernels' agreement.
    return kv_int8 is None or kv_int8["ok"]
