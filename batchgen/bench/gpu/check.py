"""The GPU check's command: run the steps one by one, each in its own process under its budget (orchestrate.py), then
write summary.json and print the closing table. With --step (set by the check itself) it runs that one step here and
writes its JSON (step_record.py)."""
from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from .options import parse_args
from .orchestrate import run_steps
from .report import summary_table
from .step_record import StepRecord, step_path, write_json
from .steps import STEP_BY_NAME, STEPS


def run_one_step(args) -> int:
    step = STEP_BY_NAME[args.step]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("batchgen").setLevel(logging.INFO)  # the KV pool, the CUDA graphs, the fallbacks
    record = StepRecord(step_path(out_dir, step.number, step.name), step.number, step.name, args.mode,
                        args.step_budget)
    try:
        ok = step.run(args, record)
    except Exception as exc:  # noqa: BLE001 -- the step's error goes into its JSON; the next step still runs
        record.finish(False, exc)
        print(f"[{step.name}] FAILED: {record['error']}", file=sys.stderr, flush=True)
    else:
        record.finish(ok)
    return 0 if record["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.step:
        return run_one_step(args)
    import torch

    steps = [step for step in STEPS if step.name in args.steps]
    no_gpu = args.device == "cuda" and not torch.cuda.is_available()
    if no_gpu:  # step 0 still says what is there
        steps = [step for step in steps if step.name == "environment"]
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="batchgen-gpu-check-")).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "mode": args.mode,
               "argv": argv, "out_dir": str(out_dir), "steps": []}
    commands = [(step.number, step.name,
                 [sys.executable, "-m", "batchgen.bench.gpu", *argv, "--step", step.name, "--out-dir", str(out_dir),
                  "--work-dir", str(work_dir), "--step-budget", str(step.budget_s[args.mode])],
                 float(step.budget_s[args.mode])) for step in steps]
    try:
        records = run_steps(commands, out_dir, args.mode, summary)
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    summary["passed"] = not no_gpu and all(r["ok"] for r in records)
    summary["wall_s"] = time.monotonic() - started
    summary["table"] = summary_table(records)
    write_json(out_dir / "summary.json", summary)
    print(f"\nGPU check ({args.mode}): {'passed' if summary['passed'] else 'NOT passed'}; every step's JSON in "
          f"{out_dir}\n", file=sys.stderr)
    print(summary["table"])
    if no_gpu:
        print("the GPU check needs a CUDA device, and torch sees none (--dry-run runs its flow on the CPU)",
              file=sys.stderr)
        return 2
    return 0 if summary["passed"] else 1
