"""Step 2: greedy equality with transformers on the same device, on random weights of the model's real shape. A few
random-token prompts, each alone and all batched: in bf16 every divergence must be a near-tie (the two tokens within
a couple of bf16 ulps in transformers' own logits); with --fp32-check (the full run) also in fp32 under the tests'
rule (batchgen/bench/greedy_check.py: within 1e-3, at most 1 prompt in 20)."""
from __future__ import annotations

import random

import torch

from .batchgen_side import batchgen_greedy, open_engine
from .device import free_device_memory
from .shapes import MODEL_CONFIGS, ModelShape, describe_model
from .transformers_side import bf16_model_and_checkpoint, checkpoint_dir, load_hf_model
from ..greedy_check import NEAR_TIE_ABS_TOL, allowed_divergences, greedy_verdict, hf_greedy_with_logits

FP32_MAX_PARAMS = 3e9  # larger models skip the fp32 check: their fp32 copy would not leave room for the engine
FP32_MIN_S = 45.0  # of the step's budget, left for the fp32 check to start (an H200 takes ~30 s for 1B)
MAX_NUM_SEQS = 16  # the few greedy prompts need no more, and the engine captures fewer CUDA graphs


def greedy_prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    low, high = min(16, args.prompt_min), min(512, args.prompt_max)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(args.greedy_prompts)]


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


def check_dtype(record, key: str, args, prompts, device: torch.device, dtype: str, rel_tol: float,
                max_divergences: int, **engine_overrides) -> bool:
    """transformers' references, then the engine's outputs against them, in one dtype; the model is built (or
    loaded) for this alone and freed before the engine starts."""
    model_dir = checkpoint_dir(args)
    if dtype == "bfloat16":
        hf = record.phase(f"hf_model_{dtype}", lambda: bf16_model_and_checkpoint(
            MODEL_CONFIGS[args.model], model_dir, device, args.seed), keep=False)
    else:
        hf = record.phase(f"hf_model_{dtype}", lambda: load_hf_model(model_dir, getattr(torch, dtype), device),
                          keep=False)
    references = None
    if hf is not None:
        references = record.phase(f"hf_greedy_{dtype}", lambda: hf_greedy_with_logits(
            hf, prompts, args.greedy_tokens), keep=False)
    hf = None
    free_device_memory()
    if references is None:
        return False
    load_key = "engine_load" if dtype == "bfloat16" else f"engine_load_{dtype}"
    opened = record.phase(load_key, lambda: open_engine(model_dir, dtype, args, **engine_overrides), keep=False)
    if opened is None:
        return False
    engine, record[load_key] = opened
    del opened
    verdict = record.phase(key, lambda: greedy_check(engine, prompts, references, rel_tol, max_divergences))
    engine = None
    free_device_memory()
    return bool(verdict and verdict["ok"])


def run_greedy(args, record) -> bool:
    device = torch.device(args.device)
    record["model"] = describe_model(args.model)
    prompts = greedy_prompts(args, ModelShape.from_config(MODEL_CONFIGS[args.model]).vocab)
    ok = check_dtype(record, "greedy_bf16", args, prompts, device, "bfloat16", args.bf16_rel_tol, len(prompts),
                     max_num_seqs=MAX_NUM_SEQS)
    if args.fp32_check and record["model"]["params"] < FP32_MAX_PARAMS:
        if not (checkpoint_dir(args) / "config.json").is_file():
            record["greedy_fp32"] = {"skipped": "no checkpoint: the bf16 model was not built"}
        elif record.seconds_left() < FP32_MIN_S:
            record["greedy_fp32"] = {"skipped": f"{record.seconds_left():.0f} s of the step's budget left"}
        else:
            ok &= check_dtype(record, "greedy_fp32", args, prompts, device, "float32", 0.0,
                              allowed_divergences(len(prompts)), max_num_seqs=MAX_NUM_SEQS,
                              kv_cache_memory=args.kv_cache_memory or "4GiB")
    return ok
