"""Run by the Python of a virtualenv holding vLLM (not by batchgen's): generate greedily for the rows of a JSON
file and write the outputs and timings as JSON. Standalone: imports nothing from batchgen.

    python vllm_worker.py IN.json OUT.json

IN:  {"model_dir": str, "enable_prefix_caching": bool, "dtype": str (default float32), "llm_kwargs": {...},
      "ignore_eos": bool (default false), "rows": [{"id": int, "prompt_token_ids": [int], "max_tokens": int}],
      "prompt_logprobs": bool (default false: score the prompts instead, one token generated a row)}
OUT: {"vllm_version", "load_s", "ready_monotonic", "wall_s", "quantization", "rows": [{"id", "token_ids",
      "num_cached_tokens", "first_token_s", "finish_s"}]}  (row times in seconds since generation started; null
      where vLLM has none; ready_monotonic: time.monotonic() once the LLM is ready, for the caller's start-up figure;
      with prompt_logprobs each row has "prompt_logprobs": the logprob of each prompt token after the first)
"""
from __future__ import annotations

import json
import sys
import time


def main(in_path: str, out_path: str) -> None:
    with open(in_path) as f:
        spec = json.load(f)
    started = time.monotonic()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model_dir"], dtype=spec.get("dtype", "float32"), seed=0, enforce_eager=True,
              enable_prefix_caching=spec["enable_prefix_caching"], disable_log_stats=False,  # per-request metrics
              **spec.get("llm_kwargs", {}))
    ready = time.monotonic()
    load_s = ready - started
    quantization = getattr(llm.llm_engine.model_config, "quantization", None)

    rows = spec["rows"]
    prompts = [TokensPrompt(prompt_token_ids=row["prompt_token_ids"]) for row in rows]
    scoring = spec.get("prompt_logprobs", False)
    params = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0) if scoring else
              SamplingParams(temperature=0.0, max_tokens=row["max_tokens"], ignore_eos=spec.get("ignore_eos", False))
              for row in rows]
    started = time.monotonic()  # vLLM's engine-core timestamps are time.monotonic() too (one clock per machine)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.monotonic() - started

    results = []
    for row, output in zip(rows, outputs):
        metrics = getattr(output, "metrics", None)
        first = getattr(metrics, "first_token_ts", 0.0) or None
        last = getattr(metrics, "last_token_ts", 0.0) or None
        results.append({"id": row["id"], "token_ids": list(output.outputs[0].token_ids),
                        "num_cached_tokens": getattr(output, "num_cached_tokens", None),
                        "first_token_s": first - started if first else None,
                        "finish_s": last - started if last else None})
        if scoring:  # position i: {token id: Logprob} holding the prompt's own token i (None at the first)
            results[-1]["prompt_logprobs"] = [entry[token].logprob for token, entry in
                                              zip(row["prompt_token_ids"][1:], output.prompt_logprobs[1:])]
    with open(out_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "load_s": load_s, "ready_monotonic": ready, "wall_s": wall_s,
                   "quantization": quantization, "rows": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
