"""Issue 43's calibrated W8A8 figures: the labeling job (jobs/labeling.yaml's prompts and rows) on a model in bf16,
int8 (W8A8, uncalibrated) and int8 calibrated on the job's own rows: the quality gate (`batchgen plan --quality`)
on the generated labels and on `choice` labels, and each run's generation time (`batchgen run`, _SUCCESS's
generation_s: the model load and the calibration excluded). Prints one JSON line and appends it to --archive.

    PYTHONPATH=$PWD:$PWD/kernels flock -x /tmp/cpu.lock python dev/w8a8_figures.py --model default --rows 16
    PYTHONPATH=$PWD:$PWD/kernels flock -x /tmp/cpu.lock python dev/w8a8_figures.py \
        --model ~/.cache/batchgen/random-models/llama-1b-bfloat16 --rows 8
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from batchgen.machine import machine_info
from batchgen.models.loader import reference_model_dir

LABELS = ["positive", "negative", "neutral"]


def job_file(root: Path, name: str, model: str, engine: dict, choice: bool) -> Path:
    job = yaml.safe_load(Path("jobs/labeling.yaml").read_text())
    job.update(model=model, dtype="bfloat16")
    job["input"]["path"] = str(Path("data/samples/labeling.parquet").resolve())
    job["engine"] = {**job["engine"], **engine}
    job["output"] = {"path": str(root / name), "keep_columns": ["product"]}
    if choice:
        job["sampling"] = {"choice": [f" {label}" for label in LABELS], "temperature": 0.0}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def gate(job: Path, rows: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "batchgen", "plan", str(job), "--quality", str(rows), "--no-probe"],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    lines = [line for line in done.stdout.splitlines() if line.startswith("quality:")]
    found = {"lines": lines}
    for line in lines:
        if m := re.search(r"greedy text agrees on (\d+)/(\d+)", line):
            found["text_agreement"] = int(m[1]) / int(m[2])
        if m := re.search(r"choice labels agree on (\d+)/(\d+)", line):
            found["choice_agreement"] = int(m[1]) / int(m[2])
        if m := re.search(r"log-likelihood difference mean ([\d.]+), max ([\d.]+)", line):
            found["loglik_mean"], found["loglik_max"] = float(m[1]), float(m[2])
        if m := re.search(r"calibration kept (.*) in the model's dtype", line):
            found["keep"] = m[1].split(", ")
    return found


def run(job: Path) -> dict:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), "--quiet", "--overwrite"],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    s = json.loads((Path(yaml.safe_load(job.read_text())["output"]["path"]) / "_SUCCESS").read_text())
    return {"available": True, "wall_s": s["generation_s"], "output_tok_s": s["output_tokens_per_s"],
            "rows_per_s": s["rows"] / s["generation_s"], "process_s": time.monotonic() - started,
            "weights_bytes": s["engine_stats"].get("weights_bytes"), "peak_memory_bytes": s["peak_memory_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=16, help="calibration rows")
    parser.add_argument("--gate-rows", type=int, default=40)
    parser.add_argument("--archive", default="docs/performance-archive.jsonl")
    parser.add_argument("--quality-json", type=Path, help="the gates' figures: read from here when it exists (only "
                        "the runs are timed then), else written here and the runs skipped (the gates need no "
                        "exclusive CPU: run them under a shared lock, the timing under an exclusive one)")
    parser.add_argument("--keep", help="comma-separated quantization_keep for the calibrated runs and the choice "
                        "gate, instead of the calibration's choice")
    args = parser.parse_args()
    model = str(reference_model_dir(args.model)) if args.model == "default" else str(Path(args.model).expanduser())
    root = Path(tempfile.mkdtemp(prefix="w8a8-"))
    int8 = {"quantization": "int8"}
    calibrated = {**int8, "quantization_calibration": {"rows": args.rows}}
    if args.quality_json and args.quality_json.exists():
        quality = json.loads(args.quality_json.read_text())
    else:
        quality = {"int8": gate(job_file(root, "g-int8", model, int8, False), args.gate_rows)}
        if args.keep:
            keep = {**int8, "quantization_keep": args.keep.split(",")}
            quality["int8-calibrated"] = gate(job_file(root, "g-cal", model, keep, False), args.gate_rows)
            quality["int8-calibrated"]["keep"] = args.keep.split(",")
        else:
            quality["int8-calibrated"] = gate(job_file(root, "g-cal", model, calibrated, False), args.gate_rows)
        keep = {**int8, "quantization_keep": quality["int8-calibrated"]["keep"]}
        quality["int8"]["choice"] = gate(job_file(root, "c-int8", model, int8, True), args.gate_rows)
        quality["int8-calibrated"]["choice"] = gate(job_file(root, "c-cal", model, keep, True), args.gate_rows)
        if args.quality_json:
            args.quality_json.write_text(json.dumps(quality))
            print(json.dumps(quality))
            return
    keep = {**int8, "quantization_keep": quality["int8-calibrated"]["keep"]}
    systems = {"bf16": run(job_file(root, "r-bf16", model, {}, False)),
               "int8": run(job_file(root, "r-int8", model, int8, False)),
               "int8-calibrated": run(job_file(root, "r-cal", model, keep, False))}
    for name, figures in systems.items():
        figures["dtype"] = "bfloat16"
        figures["quantization"] = None if name == "bf16" else {"int8": "int8 W8A8", "int8-calibrated":
                                                               "int8 W8A8 calibrated"}[name]
    comparisons = {name: {"speedup": systems["bf16"]["wall_s"] / systems[name]["wall_s"],
                          "identical_share": quality[name]["text_agreement"],
                          "choice_agreement": quality[name]["choice"].get("choice_agreement")}
                   for name in ("int8", "int8-calibrated")}
    machine = machine_info()
    record = {"kind": "w8a8-calibrated", "task": "generate", "date": datetime.now(timezone.utc).isoformat(),
              "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "workload": {"name": "labeling-job", "model": args.model, "rows": 40, "calibration_rows": args.rows},
              "machine": machine, "cpu_flags": [f for f, on in (machine.get("cpu_flags") or {}).items() if on],
              "systems": systems, "comparisons": comparisons, "quality": quality, "reference": "bf16"}
    print(json.dumps(record))
    with open(args.archive, "a") as archive:
        archive.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
