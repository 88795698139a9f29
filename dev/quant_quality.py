"""The quality gate of `quantization: int8`: the quantized model against the same model unquantized, same dtype.

1. Greedy agreement: 200 varied prompts (the bench's synthetic labeling and writing rows, plus questions of many
   kinds and lengths, all deterministic), up to 32 new tokens each, through the real engine. Reports the share of
   rows whose tokens are identical and where the others first differ.
2. Perplexity on text the model was not trained on: this repository's docs/*.md, then batchgen/**/*.py, tokenized
   as one stream and cut into windows of --window tokens; every position's logits come from batchgen's prefill
   (the model's forward, then compute_logits on all hidden states), the same windows for both models.

    PYTHONPATH=$PWD:$PWD/kernels python dev/quant_quality.py --dtype float32 bfloat16

Each quantized engine is built as `quantization: int8` builds it (the loader quantizes layer by layer, before the CPU's
weight packing); --variant tries the alternatives: `quantization: int8-weight-only` (int8 weights, bf16
activations), and no int8 LM head (by setting the loader's INT8_OPTIONS).
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from batchgen.bench.workloads import TOPICS, PromptTokenizer, synthetic_workload
from batchgen.engine.engine import Engine
from batchgen.engine.engine_args import EngineArgs
from batchgen.engine.request import Request, SamplingParams
from batchgen.models.loader import load_tokenizer, resolve_model
from batchgen.models.accounting import weight_bytes
from batchgen.models import loader
from batchgen_kernels import AttentionMetadata

ROOT = Path(__file__).resolve().parents[1]
# name -> (the engine's quantization setting, the loader's INT8_OPTIONS changed from it)
VARIANTS = {"int8": ("int8", {}), "int8-fp-lm-head": ("int8", {"lm_head": False}),
            "int8-weight-only": ("int8-weight-only", {})}
QUESTIONS = ["What is {topic}? Answer in one sentence.", "Give three facts about {topic}.",
             "Is it true that {topic} matters today? Answer yes or no, then explain briefly.",
             "Write a Python function that returns the sum of the squares of a list of numbers.",
             "Translate into French: 'The meeting is moved to Thursday at nine.'",
             "What is {a} + {b}? Reply with the number only.", "What is {a} times {b}?",
             "Write a limerick about {topic}.", "Name the capital of {country}.",
             "Summarize in two sentences: {topic} has shaped how people live, work and travel for centuries.",
             "Continue the story: The lighthouse keeper found a letter that said",
             "Write a SQL query that counts the orders per customer in a table named orders."]
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "India", "Egypt", "Peru", "Vietnam"]


def prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Half the bench's `mixed` workload (labeling and writing tasks, 50-400 tokens), half questions."""
    bench = [row.token_ids for row in synthetic_workload("mixed", count // 2, seed, tokenizer).rows]
    rng, tokenize = random.Random(seed), PromptTokenizer(tokenizer)
    questions = [tokenize(rng.choice(QUESTIONS).format(topic=rng.choice(TOPICS), a=rng.randint(2, 999),
                                                       b=rng.randint(2, 99), country=rng.choice(COUNTRIES)))
                 for _ in range(count - len(bench))]
    return bench + questions


def greedy(engine: Engine, rows: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = engine.generate(Request(i, ids, params) for i, ids in enumerate(rows))
    return [r.token_ids for r in sorted(results, key=lambda r: r.request_id)]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    firsts = []
    for a, b in zip(base, other):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"identical": 1 - len(firsts) / len(base), "diverged": len(firsts),
            "mean_first_divergence": sum(firsts) / len(firsts) if firsts else float("nan")}


def text_windows(tokenizer, num_tokens: int, window: int) -> list[list[int]]:
    files = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "batchgen").rglob("*.py"))
    ids: list[int] = []
    for path in files:
        ids += tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        if len(ids) >= num_tokens:
            break
    ids = ids[:num_tokens]
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


@torch.inference_mode()
def perplexity(model, windows: list[list[int]], block_size: int = 16) -> float:
    """exp(mean NLL) of each window's tokens 1.. given the ones before, one prefill per window."""
    window = len(windows[0])
    num_blocks = -(-window // block_size)
    cache = torch.zeros((model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim),
                        dtype=model.dtype)
    model.bind_kv_cache([cache[i, 0] for i in range(model.num_layers)], [cache[i, 1] for i in range(model.num_layers)])
    metadata = AttentionMetadata.build([window], [window], np.arange(num_blocks, dtype=np.int32)[None],
                                       np.arange(window), torch.device("cpu"))
    nll, count = 0.0, 0
    for ids in windows:
        tokens = torch.tensor(ids)
        logits = model.compute_logits(model(tokens, torch.arange(window), metadata))
        nll += torch.nn.functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum").item()
        count += window - 1
    return math.exp(nll / count)


def evaluate(dtype: str, variant: str | None, rows, windows, max_tokens: int) -> dict:
    if variant is None:
        engine = Engine(EngineArgs(dtype=dtype, kv_cache_memory="3GiB"))
    else:  # the engine's own int8 load, with the variant's options in the loader's INT8_OPTIONS
        quantization, options = VARIANTS[variant]
        with mock.patch.dict(loader.INT8_OPTIONS, options):
            engine = Engine(EngineArgs(dtype=dtype, kv_cache_memory="3GiB", quantization=quantization))
    start = time.perf_counter()
    outputs = greedy(engine, rows, max_tokens)
    generate_s = time.perf_counter() - start
    ppl = perplexity(engine.model, windows)
    return {"outputs": outputs, "ppl": ppl, "weight_bytes": weight_bytes(engine.model), "generate_s": generate_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--variant", nargs="+", default=["int8"], choices=list(VARIANTS))
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ppl-tokens", type=int, default=50_000)
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(resolve_model("default"))
    rows = prompts(tokenizer, args.prompts)
    windows = text_windows(tokenizer, args.ppl_tokens, args.window)
    lengths = sorted(len(r) for r in rows)
    print(f"{len(rows)} prompts of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), "
          f"greedy, up to {args.max_tokens} new tokens; perplexity over {len(windows)} windows of {args.window} "
          f"tokens ({len(windows) * args.window:,} tokens of docs/*.md and batchgen/**/*.py)", flush=True)
    print("| dtype | model | weights MiB | perplexity | identical rows | mean first divergence (of diverged) |")
    print("|---|---|---:|---:|---:|---:|")
    bases = {}
    for dtype in args.dtype:
        base = bases[dtype] = evaluate(dtype, None, rows, windows, args.max_tokens)
        print(f"| {dtype} | unquantized | {base['weight_bytes'] / 2**20:,.0f} | {base['ppl']:.3f} | - | - |",
              flush=True)
        for variant in args.variant:
            if variant == "int8-weight-only" and dtype == "float32":
                continue  # aten._weight_int8pack_mm has no fast fp32 kernel: not a configuration anyone would run
            quant = evaluate(dtype, variant, rows, windows, args.max_tokens)
            agree = agreement(base["outputs"], quant["outputs"])
            print(f"| {dtype} | {variant} | {quant['weight_bytes'] / 2**20:,.0f} | {quant['ppl']:.3f} "
                  f"({(quant['ppl'] / base['ppl'] - 1) * 100:+.2f}%) | {agree['identical'] * 100:.1f}% "
                  f"({len(rows) - agree['diverged']}/{len(rows)}) | {agree['mean_first_divergence']:.1f} |",
                  flush=True)
    if len(bases) == 2:  # the yardstick: how far bf16 itself is from fp32, on the same measures
        fp32, bf16 = bases["float32"], bases["bfloat16"]
        agree = agreement(fp32["outputs"], bf16["outputs"])
        print(f"| bfloat16 vs float32 (yardstick) | unquantized | - | {bf16['ppl']:.3f} "
              f"({(bf16['ppl'] / fp32['ppl'] - 1) * 100:+.2f}%) | {agree['identical'] * 100:.1f}% "
              f"({len(rows) - agree['diverged']}/{len(rows)}) | {agree['mean_first_divergence']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
