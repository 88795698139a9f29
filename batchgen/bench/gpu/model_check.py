"""The GPU check of one model: build and save it, transformers' greedy references and static-batching throughput,
then batchgen's greedy check, throughput and decode step times, and the fp32 greedy check of a small model."""
from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path

import torch

from .device import free_device_memory
from .batchgen_side import batchgen_greedy, batchgen_throughput, cuda_graph_batch_sizes, decode_step_times, open_engine
from .report import Phases
from .shapes import MODEL_CONFIGS, MODEL_NAMES, ModelShape
from .transformers_side import build_and_save, hf_static_throughput, load_hf_model
from ..greedy_check import NEAR_TIE_ABS_TOL, allowed_divergences, greedy_verdict, hf_greedy_with_logits
from ..workloads import random_token_rows


def check_model(key: str, work_dir: Path, device: torch.device, rates: dict, args) -> dict:
    config = MODEL_CONFIGS[key]
    shape = ModelShape.from_config(config)
    record = {"name": MODEL_NAMES[key], "config": config, "shape": asdict(shape), "params": shape.num_params}
    phases = Phases(record, key)
    rng = random.Random(args.seed)
    low, high = min(16, args.prompt_min), min(512, args.prompt_max)
    prompts = [[rng.randrange(shape.vocab) for _ in range(rng.randint(low, high))] for _ in range(args.greedy_prompts)]
    workload = random_token_rows(args.requests, (args.prompt_min, args.prompt_max), (args.output_min, args.output_max),
                                 shape.vocab, args.seed)
    hf_subset = random.Random(args.seed + 1).sample(workload, min(args.hf_requests, len(workload)))
    model_dir = work_dir / key

    # transformers first, then batchgen: never both models on the device at once.
    hf = phases.run("build_and_save", lambda: build_and_save(config, model_dir, device, args.seed), keep=False)
    references = None
    if hf is not None:
        references = phases.run("hf_greedy_bf16", lambda: hf_greedy_with_logits(hf, prompts, args.greedy_tokens),
                                keep=False)
        if not args.skip_hf_throughput:
            phases.run("hf_static", lambda: hf_static_throughput(hf, hf_subset, args.hf_batch_size,
                                                                 args.hf_time_limit))
    del hf
    free_device_memory()
    if not (model_dir / "config.json").is_file():
        return record

    opened = phases.run("engine_load", lambda: open_engine(model_dir, "bfloat16", args), keep=False)
    if opened is not None:
        engine, load_s = opened
        del opened
        graph_sizes = cuda_graph_batch_sizes(engine)
        record["engine_load"] = {"load_s": load_s, "kv_cache_tokens": engine.stats()["kv_cache_tokens"],
                                 "max_model_len": engine.max_model_len, "cuda_graph_batch_sizes": graph_sizes}
        if device.type == "cuda" and graph_sizes is None:
            record["engine_load"]["error"] = "the engine runs without CUDA graphs (see the warning in its log)"
        if references is not None:
            phases.run("greedy_bf16", lambda: greedy_check(engine, prompts, references, args.bf16_rel_tol,
                                                           len(prompts)))
        phases.run("batchgen", lambda: batchgen_throughput(engine, workload, args.time_limit))
        record["decode"] = {}
        for batch_size in args.decode_batch_sizes:
            if batch_size > args.max_num_seqs:
                continue
            Phases(record["decode"], f"{key} decode").run(str(batch_size), lambda b=batch_size: decode_step_times(
                engine, shape, b, args.decode_context, args.decode_steps, rates, args.seed))
        del engine
        free_device_memory()

    if args.fp32_check and shape.num_params < 3e9:
        phases.run("greedy_fp32", lambda: fp32_greedy_check(model_dir, prompts, device, args))
    return record


def greedy_check(engine, prompts: list[list[int]], references, rel_tol: float, max_divergences: int) -> dict:
    """batchgen's greedy outputs, each prompt alone and all batched together, against transformers' (tokens,
    logits); near-ties within NEAR_TIE_ABS_TOL + rel_tol x the logit."""
    tokens, logits = references
    verdicts = {}
    for together in (False, True):
        outputs = batchgen_greedy(engine, prompts, len(tokens[0]), together)
        verdicts["batched" if together else "alone"] = greedy_verdict(
            tokens, logits, outputs, rel_tol, NEAR_TIE_ABS_TOL, max_divergences)
    return {"ok": all(v["ok"] for v in verdicts.values()), **verdicts}


def fp32_greedy_check(model_dir: Path, prompts: list[list[int]], device: torch.device, args) -> dict:
    """fp32 on both sides, under the tests' rule (batchgen/bench/greedy_check.py: within 1e-3, at most 1 prompt
    in 20)."""
    hf = load_hf_model(model_dir, torch.float32, device)
    references = hf_greedy_with_logits(hf, prompts, args.greedy_tokens)
    del hf
    free_device_memory()
    engine, _ = open_engine(model_dir, "float32", args, kv_cache_memory=args.kv_cache_memory or "4GiB",
                            max_num_seqs=16)
    try:
        return greedy_check(engine, prompts, references, 0.0, allowed_divergences(len(prompts)))
    finally:
        del engine
        free_device_memory()
