"""The GPU check's options. Each mode (full, --quick, --dry-run) has its own defaults; an option given on the
command line overrides its mode's value."""
from __future__ import annotations

import argparse
import os
from datetime import datetime, timezone

from .shapes import MODEL_CONFIGS

MODES = ("full", "quick", "dry-run")

_WORKLOAD_FULL = dict(requests=1000, prompt_min=100, prompt_max=1000, output_min=100, output_max=500)
# Each mode's values, chosen so that the steps' work fits their budgets (steps.py) on an H200.
MODE_DEFAULTS = {
    "full": dict(model="1b", **_WORKLOAD_FULL, time_limit=60.0, hf_requests=256, hf_batch_size=256,
                 hf_time_limit=60.0, greedy_prompts=6, greedy_tokens=32, fp32_check=True,
                 decode_batch_sizes=[1, 32, 256], decode_context=512, decode_steps=64, max_num_seqs=256,
                 kv_cache_memory=None, attention_backend="auto"),
    "quick": dict(model="1b", **{**_WORKLOAD_FULL, "requests": 200}, time_limit=25.0, hf_requests=64,
                  hf_batch_size=64, hf_time_limit=25.0, greedy_prompts=4, greedy_tokens=16, fp32_check=False,
                  decode_batch_sizes=[1, 32], decode_context=512, decode_steps=16, max_num_seqs=64,
                  kv_cache_memory=None, attention_backend="auto"),
    # the CPU, a tiny model and the torch reference attention: the flow of the check, not its figures
    "dry-run": dict(model="tiny", requests=10, prompt_min=5, prompt_max=40, output_min=2, output_max=12,
                    time_limit=30.0, hf_requests=4, hf_batch_size=2, hf_time_limit=30.0, greedy_prompts=3,
                    greedy_tokens=6, fp32_check=True, decode_batch_sizes=[1, 4], decode_context=20, decode_steps=3,
                    max_num_seqs=8, kv_cache_memory="16MiB", attention_backend="torch"),
}
STEP_NAMES = ("environment", "kernel_tests", "greedy", "throughput")  # in order; steps.py runs them


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m batchgen.bench --gpu",
        description="The GPU check, in steps that each write their JSON as soon as they end: 0 environment, "
                    "1 the Triton kernel tests on the GPU, 2 greedy equality with transformers, 3 throughput and "
                    "decode step times. Options left out take their mode's value (options.py: MODE_DEFAULTS).")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a smaller run that fits in 4 minutes on an H200")
    mode.add_argument("--dry-run", action="store_true",
                      help="the same steps on the CPU with a tiny model and the torch attention (tests the check)")
    p.add_argument("--out-dir", help="where each step's JSON goes (default: $OUT, else bench-results/gpu-check-<UTC>)")
    p.add_argument("--steps", nargs="+", choices=STEP_NAMES, help="run only these steps (default: all four)")
    p.add_argument("--work-dir", help="where the model checkpoint and test records go (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=sorted(MODEL_CONFIGS), help="model shape (random weights)")
    p.add_argument("--requests", type=int, help="offline workload: number of requests")
    p.add_argument("--prompt-min", type=int)
    p.add_argument("--prompt-max", type=int)
    p.add_argument("--output-min", type=int)
    p.add_argument("--output-max", type=int)
    p.add_argument("--time-limit", type=float, help="seconds batchgen's workload may run (less if the step's budget "
                                                    "is shorter)")
    p.add_argument("--hf-requests", type=int, help="requests (a random subset) for transformers")
    p.add_argument("--hf-batch-size", type=int)
    p.add_argument("--hf-time-limit", type=float, help="transformers starts no new batch after this many seconds")
    p.add_argument("--greedy-prompts", type=int)
    p.add_argument("--greedy-tokens", type=int)
    p.add_argument("--bf16-rel-tol", type=float, default=2.0 ** -6,
                   help="bf16 near-tie tolerance relative to the logit (2**-6: 2 to 4 bf16 ulps)")
    p.add_argument("--fp32-check", action=argparse.BooleanOptionalAction,
                   help="also the fp32 greedy check (models under 3e9 parameters)")
    p.add_argument("--decode-batch-sizes", type=int, nargs="+")
    p.add_argument("--decode-context", type=int, help="prompt tokens of each decoding sequence")
    p.add_argument("--decode-steps", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, help="default: the longest request rounded up to 256, at least 2048")
    p.add_argument("--kv-cache-memory", help="a fixed KV budget, e.g. 40GiB (default on a GPU: from free memory)")
    p.add_argument("--attention-backend", choices=("auto", "torch", "triton", "cpu"))
    # set by the check for the process that runs one step
    p.add_argument("--step", choices=STEP_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--step-budget", type=float, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    args.mode = "quick" if args.quick else "dry-run" if args.dry_run else "full"
    for key, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = "cpu" if args.mode == "dry-run" else "cuda"
    if args.max_model_len is None:
        longest = max(args.prompt_max + args.output_max, args.decode_context + args.decode_steps + 128, 512 + 64)
        args.max_model_len = max(2048, -(-longest // 256) * 256)
    if args.out_dir is None:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        args.out_dir = os.environ.get("OUT") or f"bench-results/gpu-check-{stamp}"
    args.steps = args.steps or list(STEP_NAMES)
    return args
