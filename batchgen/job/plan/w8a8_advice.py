"""Whether W8A8 (`quantization: int8`) pays on this kind of CPU, and with which activations, from the latest
`dev/w8a8_figures.py` record of the same CPU name, core count and instruction sets in the bench archive: per model
measured, each variant's generation time against bf16 on the labeling job and how many labels it kept. Records of
kind w8a8-activations compare the calibration's activations (dynamic, static, smooth:
quantization_calibration.activations); older ones (w8a8-calibrated) only calibrated against uncalibrated. W8A8
multiplies int8 x int8 (oneDNN's quantized linear, AMX/VNNI where the CPU has them) but quantizes the activations on
the way in, and the layers the calibration keeps run in the dtype: where bf16 already runs on AMX tiles, that can
cost more than the int8 multiplications save."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .throughput import same_cpu

KINDS = ("w8a8-activations", "w8a8-calibrated")  # the newer kind first: it wins a model both measured
PAYS = 1.05  # said to pay only past this speed ratio: the runs' spread on a shared 2-core machine is a few %


def calibrated_w8a8_advice(archive: Path, device: dict[str, Any], quantization: str | None) -> list[str]:
    """The plan's lines for a job with quantization int8: each model's latest record on this CPU kind."""
    if quantization != "int8" or device.get("type") != "cpu" or not archive.is_file():
        return []
    latest: dict[str, dict] = {}
    for line in archive.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") in KINDS and same_cpu(record.get("machine", {}), device) and \
                not record.get("workload", {}).get("name", "").startswith("labeling-job-decode"):
            model = record["workload"]["model"]
            rank = (KINDS[::-1].index(record["kind"]), record["date"])
            held = latest.get(model)
            if held is None or rank >= (KINDS[::-1].index(held["kind"]), held["date"]):
                latest[model] = record
    if not latest:  # nothing measured here: the roofline advice above says how to measure
        return []
    lines = []
    for model, record in sorted(latest.items()):
        compared = record["comparisons"]
        lines.append(f"  W8A8 on {model} (labeling job, {record['date'][:10]}), against bf16:")
        for name, figures in compared.items():
            verdict = "pays" if figures["speedup"] >= PAYS else "does not pay (bf16 is as fast or faster)"
            label = {"int8": "uncalibrated", "int8-calibrated": "calibrated"}.get(name, name.removeprefix("int8-"))
            lines.append(f"    {label}: {figures['speedup']:.2f}x bf16's speed, {figures['identical_share']:.0%} of "
                         f"greedy labels kept: {verdict} on this CPU")
    return ["precision: W8A8 measured on this CPU kind (quantization_calibration.activations):"] + lines
