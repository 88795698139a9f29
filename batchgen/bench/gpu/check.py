"""The GPU check's command: its options, the run over the models, the JSON record and the closing table."""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .device import copy_bandwidth, describe_device, free_device_memory, matmul_rate
from .model_check import check_model
from .report import Phases, errors, passed, summary_table, targets
from .shapes import MODEL_CONFIGS

_DESCRIPTION = "The GPU check: batchgen on one CUDA device, with random-weight Llama models of real shapes."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m batchgen.bench.gpu", description=_DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a ~1 minute smoke run: the 1B shape only, 100 requests, fewer prompts and steps")
    p.add_argument("--out", help="JSON file (default: bench-results/gpu-<UTC timestamp>.json)")
    p.add_argument("--models", nargs="+", choices=sorted(MODEL_CONFIGS), default=["1b", "8b"])
    p.add_argument("--requests", type=int, default=1000, help="synthetic offline workload: number of requests")
    p.add_argument("--prompt-min", type=int, default=100)
    p.add_argument("--prompt-max", type=int, default=1000)
    p.add_argument("--output-min", type=int, default=100)
    p.add_argument("--output-max", type=int, default=500)
    p.add_argument("--time-limit", type=float, default=180.0, help="seconds batchgen's workload may run per model")
    p.add_argument("--hf-requests", type=int, default=256, help="requests (a random subset) for transformers")
    p.add_argument("--hf-batch-size", type=int, default=256)
    p.add_argument("--hf-time-limit", type=float, default=90.0,
                   help="transformers starts no new batch after this many seconds")
    p.add_argument("--skip-hf-throughput", action="store_true")
    p.add_argument("--greedy-prompts", type=int, default=6)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--bf16-rel-tol", type=float, default=2.0 ** -6,
                   help="bf16 near-tie tolerance relative to the logit (2**-6: 2 to 4 bf16 ulps)")
    p.add_argument("--no-fp32-check", dest="fp32_check", action="store_false",
                   help="skip the fp32 greedy check of the small model")
    p.add_argument("--decode-batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--decode-context", type=int, default=512, help="prompt tokens of each decoding sequence")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the workload's longest request rounded up to 256, at least 2048")
    p.add_argument("--kv-cache-memory", help="a fixed KV budget, e.g. 40GiB (default: from free GPU memory)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of the whole check (with --models tiny and a --kv-cache-memory)")
    p.add_argument("--work-dir", help="where the checkpoints are written (default: a temp dir, removed after)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.models = ["1b"]
        args.requests = min(args.requests, 100)
        args.hf_requests = min(args.hf_requests, 64)
        args.hf_batch_size = min(args.hf_batch_size, 64)
        args.greedy_prompts, args.greedy_tokens, args.decode_steps = 4, 16, 16
    if args.max_model_len is None:
        longest = max(args.prompt_max + args.output_max, args.decode_context + args.decode_steps + 128, 512 + 64)
        args.max_model_len = max(2048, -(-longest // 256) * 256)
    return args


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("the GPU check needs a CUDA device, and torch sees none", file=sys.stderr)
        return 2
    import transformers

    device = torch.device(args.device)
    started = time.perf_counter()
    stamp = datetime.now(timezone.utc)
    record = {"started": stamp.isoformat(timespec="seconds"), "argv": sys.argv[1:] if argv is None else argv,
              "settings": vars(args),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "triton": _version("triton"),
                           "transformers": transformers.__version__},
              "device": describe_device(device), "models": {}}
    small = device.type != "cuda"  # a dry run: measure the CPU quickly
    Phases(record["device"], "device").run("copy_bandwidth_bytes_per_s", lambda: copy_bandwidth(
        device, nbytes=2**26 if small else 2 * 2**30))
    Phases(record["device"], "device").run("bf16_matmul_flops_per_s", lambda: matmul_rate(
        device, n=512 if small else 8192))
    free_device_memory()

    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="batchgen-gpu-check-"))
    try:
        for key in args.models:
            record["models"][key] = check_model(key, work_dir, device, record["device"], args)
            shutil.rmtree(work_dir / key, ignore_errors=True)
            free_device_memory()
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
        record["wall_s"] = time.perf_counter() - started
        for m in record["models"].values():
            m["targets"] = targets(m)
        record["errors"] = errors(record)
        record["passed"] = passed(record)
        out = Path(args.out or f"bench-results/gpu-{stamp.strftime('%Y%m%dT%H%M%SZ')}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"\nfull figures: {out}\n", file=sys.stderr)
    print(summary_table(record))
    return 0 if record["passed"] else 1

