"""Issue 43's W8A8 figures: the labeling job (jobs/labeling.yaml's prompts and rows) on a model in bf16, int8 (W8A8,
uncalibrated) and int8 calibrated on the job's own rows with each activations choice (dynamic, static, smooth:
quantization_calibration.activations): the quality gate (`batchgen plan --quality`, which reads the calibrated run's
_calibration.json back) on the generated labels and on `choice` labels, and each run's generation time (`batchgen
run`, _SUCCESS's generation_s: the model load excluded; the timed runs take the calibration's layers and scales as
settings, so they calibrate nothing). Prints one JSON line and appends it to --archive (kind w8a8-activations).

    PYTHONPATH=$PWD:$PWD/kernels flock -s /tmp/cpu.lock python dev/w8a8_figures.py --quality-json /tmp/q.json
    PYTHONPATH=$PWD:$PWD/kernels flock -x /tmp/cpu.lock python dev/w8a8_figures.py --quality-json /tmp/q.json
    PYTHONPATH=$PWD:$PWD/kernels flock -x /tmp/cpu.lock python dev/w8a8_figures.py --quality-json /tmp/q.json \
        --decode 64
    (--model ~/.cache/batchgen/random-models/llama-1b-bfloat16 --rows 8: the 1B shape)
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


def job_file(root: Path, name: str, model: str, engine: dict, choice: bool, decode: dict | None = None) -> Path:
    job = yaml.safe_load(Path("jobs/labeling.yaml").read_text())
    job.update(model=model, dtype="bfloat16")
    job["input"]["path"] = str(Path("data/samples/labeling.parquet").resolve())
    job["engine"] = {**job["engine"], **engine}
    job["output"] = {"path": str(root / name), "keep_columns": ["product"]}
    if choice:
        job["sampling"] = {"choice": [f" {label}" for label in LABELS], "temperature": 0.0}
    if decode:
        job["sampling"] = {**job["sampling"], **decode}
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
        if m := re.search(r"on the (\d+) it decides clearly, (\d+)/\d+ agree", line):
            found["decided_rows"], found["decided_agreement"] = int(m[1]), int(m[2]) / max(int(m[1]), 1)
        if m := re.search(r"choice labels agree on (\d+)/(\d+)", line):
            found["choice_agreement"] = int(m[1]) / int(m[2])
        if m := re.search(r"log-likelihood difference mean ([\d.]+), max ([\d.]+)", line):
            found["loglik_mean"], found["loglik_max"] = float(m[1]), float(m[2])
        if m := re.search(r"quality: calibration (read from the output's _calibration.json|measured now)", line):
            found["calibration_source"] = m[1]
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


VARIANTS = ("dynamic", "static", "smooth")  # quantization_calibration.activations


def calibrate(root: Path, model: str, variant: str, rows: int, gate_rows: int, alpha: float | None = None) -> dict:
    """One calibrated run of the labeling job (its _calibration.json), the gate on it (which reads that file back)
    and the choice gate with the calibration's layers and scales set by hand (another job: another fingerprint).
    `alpha`: smooth's, set (none: the calibration searches it)."""
    engine = {"quantization": "int8", "quantization_calibration": {
        "rows": rows, "activations": variant, **({"alpha": alpha} if alpha is not None and variant == "smooth" else {})}}
    job = job_file(root, f"cal-{variant}", model, engine, False)
    run(job)
    record = json.loads((root / f"cal-{variant}" / "_calibration.json").read_text())
    found = gate(job, gate_rows)
    found["keep"], found["scales"] = record["keep"], record.get("activation_scales") or None
    found["choice"] = gate(job_file(root, f"c-{variant}", model, fixed(found), True), gate_rows)
    return found


def ranges_only(root: Path, model: str, variant: str, rows: int, gate_rows: int) -> dict:
    """As calibrate, without the per-layer sensitivities (their passes are most of a calibration's time): the scales
    from one unquantized pass over the calibration rows, quantization.DEFAULT_KEEP kept (what the 0.01 threshold
    kept on the default model with dynamic activations)."""
    from batchgen.engine import Engine, EngineArgs
    from batchgen.engine.calibration import measure, quantizable_layers
    from batchgen.job.calibration import calibration_rows, read_rows
    from batchgen.job.config import load_job
    from batchgen.job.input.files import inspect_input
    from batchgen.models.quantization import DEFAULT_KEEP, is_kept

    job = job_file(root, f"ranges-{variant}", model, {}, False)
    config = load_job(job)
    inputs = inspect_input(config)
    engine = Engine(EngineArgs(model=model, dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory="512MiB",
                               max_num_seqs=rows))
    built = read_rows(config, inputs, engine.tokenizer, engine.max_model_len, calibration_rows(inputs.total_rows, rows))
    layers = [name for name in quantizable_layers(engine.model) if not is_kept(name, DEFAULT_KEEP)]
    scales = measure(engine, [ids for _, ids in built], layers, variant, sensitivities=False).scales
    del engine
    found = {"keep": list(DEFAULT_KEEP), "scales": scales or None}
    found.update(gate(job_file(root, f"g-{variant}", model, fixed(found), False), gate_rows))
    found["choice"] = gate(job_file(root, f"c-{variant}", model, fixed(found), True), gate_rows)
    return found


def fixed(found: dict) -> dict:
    """The engine settings of a calibrated variant without its calibration: its layers kept and scales."""
    return {"quantization": "int8", "quantization_keep": found["keep"],
            **({"quantization_scales": found["scales"]} if found.get("scales") else {})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=16, help="calibration rows")
    parser.add_argument("--gate-rows", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the activations to calibrate and time")
    parser.add_argument("--ranges-only", action="store_true", help="scales without sensitivities, o_proj and the "
                        "LM head kept (ranges_only): minutes instead of a calibration per variant")
    parser.add_argument("--static-quantile", type=float, help="engine/calibration.STATIC_QUANTILE for --ranges-only "
                        "(the quantile of the tokens' largest |x| a static scale is made from; default: 1.0, the max)")
    parser.add_argument("--decode", type=int, default=0, help="time a decode-heavy variant of the job instead: "
                        "this many output tokens per row, end of sequence ignored (quality is not gated)")
    parser.add_argument("--alpha", type=float, help="smooth's SmoothQuant alpha, set (default: searched)")
    parser.add_argument("--archive", default="docs/performance-archive.jsonl")
    parser.add_argument("--quality-json", type=Path, help="the gates' figures and each variant's layers and scales: "
                        "read from here when it exists (only the runs are timed then), else written here and the runs "
                        "skipped (the gates need no exclusive CPU: run them under a shared lock, the timing under an "
                        "exclusive one)")
    args = parser.parse_args()
    if args.static_quantile is not None:
        from batchgen.engine import calibration
        calibration.STATIC_QUANTILE = args.static_quantile
    model = str(reference_model_dir(args.model)) if args.model == "default" else str(Path(args.model).expanduser())
    root = Path(tempfile.mkdtemp(prefix="w8a8-"))
    int8 = {"quantization": "int8"}
    variants = args.variants.split(",")
    if args.quality_json and args.quality_json.exists():
        quality = json.loads(args.quality_json.read_text())
    else:
        quality = {}
        if args.static_quantile is None:  # a quantile's run measures static only
            quality["int8"] = gate(job_file(root, "g-int8", model, int8, False), args.gate_rows)
            quality["int8"]["choice"] = gate(job_file(root, "c-int8", model, int8, True), args.gate_rows)
        for variant in variants:
            quality[f"int8-{variant}"] = ranges_only(root, model, variant, args.rows, args.gate_rows) \
                if args.ranges_only else calibrate(root, model, variant, args.rows, args.gate_rows, args.alpha)
        if args.quality_json:
            args.quality_json.write_text(json.dumps(quality))
            print(json.dumps({name: {k: v for k, v in q.items() if k != "scales"} for name, q in quality.items()}))
            return
    decode = {"max_tokens": args.decode, "ignore_eos": True} if args.decode else None
    names = ["int8"] + [f"int8-{variant}" for variant in variants]
    systems = {"bf16": run(job_file(root, "r-bf16", model, {}, False, decode))}
    for name in names:
        systems[name] = run(job_file(root, f"r-{name}", model, fixed(quality[name]) if name != "int8" else int8,
                                     False, decode))
        systems[name]["quantization"] = f"int8 W8A8 {name.removeprefix('int8-') if name != 'int8' else 'uncalibrated'}"
    systems["bf16"]["quantization"] = None
    for figures in systems.values():
        figures["dtype"] = "bfloat16"
    comparisons = {name: {"speedup": systems["bf16"]["wall_s"] / systems[name]["wall_s"],
                          "identical_share": quality[name]["text_agreement"],
                          "choice_agreement": quality[name]["choice"].get("choice_agreement")} for name in names}
    machine = machine_info()
    record = {"kind": "w8a8-activations", "task": "generate", "date": datetime.now(timezone.utc).isoformat(),
              "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "workload": {"name": "labeling-job" + (f"-decode-{args.decode}" if args.decode else ""),
                           "model": args.model, "rows": 40, "calibration_rows": args.rows},
              "machine": machine, "cpu_flags": [f for f, on in (machine.get("cpu_flags") or {}).items() if on],
              "systems": systems, "comparisons": comparisons, "reference": "bf16",
              "quality": {name: {k: v for k, v in q.items() if k != "scales"} for name, q in quality.items()}}
    print(json.dumps(record))
    with open(args.archive, "a") as archive:
        archive.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
