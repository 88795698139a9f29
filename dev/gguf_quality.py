"""Greedy agreement of the default model as batchgen runs it from its GGUF (int8) with transformers' own fp32 run of
the same GGUF (dequantized), on data/samples/prompts.parquet (30 prompts, chat template), first N greedy tokens.

    PYTHONPATH=$PWD:$PWD/kernels python dev/gguf_quality.py --tokens 32 --float-dir /tmp/default-fp32

--float-dir: where the fp32 conversion of the same GGUF goes (made there if absent; outside git).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else len(a)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--float-dir", type=Path, required=True)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, GgufConfig

    from batchgen.bench.greedy_check import hf_greedy
    from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
    from batchgen.models.gguf_convert import convert_gguf
    from batchgen.models.named import NAMED_MODELS

    gguf = NAMED_MODELS["default"].gguf("default")
    if not args.float_dir.exists():
        args.float_dir.mkdir(parents=True)
        convert_gguf(gguf, args.float_dir, int8=False)
    texts = pq.read_table("data/samples/prompts.parquet").column("prompt").to_pylist()
    variants = {"int8 (GGUF), bf16 activations (weight-only): batchgen's default here": ("default", "bfloat16"),
                "int8 (GGUF), fp32 activations (W8A8)": ("default", "float32"),
                "before: fp32 conversion, bf16": (str(args.float_dir), "bfloat16"),
                "before: fp32 conversion, fp32": (str(args.float_dir), "float32")}
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                              quantization_config=GgufConfig(dequantize=True)).eval()
    results = {}
    prompts = None
    for name, (model, dtype) in variants.items():
        engine = Engine(EngineArgs(model=model, dtype=dtype, kv_cache_memory="256MiB", max_num_seqs=32))
        if prompts is None:
            prompts = [list(engine.tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                                 add_generation_prompt=True, tokenize=True,
                                                                 return_dict=True)["input_ids"]) for t in texts]
            start = time.time()
            references = [hf_greedy(hf, p, args.tokens) for p in prompts]
            print(f"transformers fp32 references: {time.time() - start:.0f} s")
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
        out = {r.request_id: r.token_ids for r in engine.generate(Request(i, p, params)
                                                                  for i, p in enumerate(prompts))}
        ours = [out[i] for i in range(len(prompts))]
        same = [first_divergence(r, o) for r, o in zip(references, ours)]
        identical = sum(r == o for r, o in zip(references, ours))
        results[name] = {"identical_rows": identical, "rows": len(prompts),
                         "mean_matching_prefix": sum(same) / len(same),
                         "mean_reference_length": sum(map(len, references)) / len(references),
                         "weights_MiB": round(sum(t.numel() * t.element_size() for t in
                                                  [*engine.model.parameters(), *engine.model.buffers()]) / 2**20)}
        print(name, json.dumps(results[name]), flush=True)
        del engine


if __name__ == "__main__":
    main()
