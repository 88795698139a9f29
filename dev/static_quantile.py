"""Which quantile of the calibration tokens' largest |x| makes the best static scale (engine/calibration.py's
STATIC_QUANTILE): each quantizable layer's sensitivity (mean KL of the next-token distributions with that layer alone
in W8A8, static scale) on the labeling job's rows, per quantile, against dynamic per-token scales.

    PYTHONPATH=$PWD:$PWD/kernels flock -s /tmp/cpu.lock python dev/static_quantile.py --model default --rows 16
"""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from batchgen.engine import calibration
from batchgen.engine.engine import Engine
from batchgen.engine.engine_args import EngineArgs
from batchgen.job.calibration import calibration_rows, read_rows
from batchgen.job.config import load_job
from batchgen.job.input.files import inspect_input
from batchgen.models.loader import reference_model_dir
from batchgen.models.quantization import DEFAULT_KEEP, is_kept


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--quantiles", default="1.0,0.999,0.99")
    args = parser.parse_args()
    model = str(reference_model_dir(args.model)) if args.model == "default" else str(Path(args.model).expanduser())
    job = yaml.safe_load(Path("jobs/labeling.yaml").read_text())
    job.update(model=model, dtype="bfloat16")
    job["input"]["path"] = str(Path("data/samples/labeling.parquet").resolve())
    path = Path("/tmp/static_quantile_job.yaml")
    path.write_text(yaml.safe_dump(job))
    config = load_job(path)
    inputs = inspect_input(config)
    engine = Engine(EngineArgs(model=model, dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory="512MiB"))
    rows = read_rows(config, inputs, engine.tokenizer, engine.max_model_len, calibration_rows(inputs.total_rows,
                                                                                              args.rows))
    prompts = [ids for _, ids in rows]
    layers = [name for name in calibration.quantizable_layers(engine.model) if not is_kept(name, DEFAULT_KEEP)]
    print("| activations | mean KL over layers | max KL | layers above 0.01 |")
    print("|---|---:|---:|---:|")
    for label, activations, quantile in [("dynamic", "dynamic", None)] + [
            (f"static, quantile {q}", "static", float(q)) for q in args.quantiles.split(",")]:
        if quantile is not None:
            calibration.STATIC_QUANTILE = quantile
        found = calibration.measure(engine, prompts, layers, activations)
        kl = list(found.sensitivity.values())
        print(f"| {label} | {sum(kl) / len(kl):.4f} | {max(kl):.4f} | {sum(v > 0.01 for v in kl)} |", flush=True)


if __name__ == "__main__":
    main()
