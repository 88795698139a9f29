"""Whether W8A8 (`quantization: int8`) pays on this kind of CPU, and with which activations, from the latest
`dev/w8a8_figures.py` record of the same CPU name, core count and instruction sets in the bench archive: per model
measured, each variant's generation time against bf16 on the labeling job and how many labels it kept. Records of
kind w8a8-activations compare the calibration's activations (dynamic, static, smooth:
quantization_calibration.activations); older ones (w8a8-calibrated) only calibrated against uncalibrated. W8A8
multiplies int8 x int8 (oneDNN's quantized linear, AMX/VNNI where the CPU has them) but quantizes the activations on
the way in, and the layers the calibration keeps run in the dtype: where bf16 already runs on AMX tiles, that can
cost more than the int8 multiplications save. Records of kind w8a8-activations-speed (dev/w8a8_speed.py) time the
variants on a model shape with random weights, where labels say nothing: speed only. A w8a8-calibrated record older
than this CPU kind's newest record of the other kinds is not read: it timed the int8 GEMM those replaced."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .throughput import same_cpu

KINDS = ("w8a8-activations", "w8a8-calibrated")  # the newer kind first: it wins a model both measured
SPEED_KIND = "w8a8-activations-speed"
PAYS = 1.05  # said to pay only past this speed ratio: the runs' spread on a shared 2-core machine is a few %


def calibrated_w8a8_advice(archive: Path, device: dict[str, Any], quantization: str | None) -> list[str]:
    """The plan's lines for a job with quantization int8: each model's latest record on this CPU kind."""
    if quantization != "int8" or device.get("type") != "cpu" or not archive.is_file():
        return []
    records = [record for line in archive.read_text().splitlines() if line.strip()
               for record in [json.loads(line)] if same_cpu(record.get("machine", {}), device)]
    newest = max((r["date"] for r in records if r.get("kind") in (KINDS[0], SPEED_KIND)), default="")
    latest: dict[str, dict] = {}
    for record in records:
        if record.get("kind") in KINDS and not record.get("workload", {}).get("name", "").startswith(
                "labeling-job-decode") and not (record["kind"] == KINDS[1] and record["date"] < newest):
            model = record["workload"]["model"]
            rank = (KINDS[::-1].index(record["kind"]), record["date"])
            held = latest.get(model)
            if held is None or rank >= (KINDS[::-1].index(held["kind"]), held["date"]):
                latest[model] = record
    speed: dict[str, dict] = {}
    for record in records:
        if record.get("kind") == SPEED_KIND and record["date"] >= speed.get(record["workload"]["model"], {}).get(
                "date", ""):
            speed[record["workload"]["model"]] = record
    if not latest and not speed:  # nothing measured here: the roofline advice above says how to measure
        return []
    lines = []
    for model, record in sorted(latest.items()):
        compared = record["comparisons"]
        lines.append(f"  W8A8 on {model} (labeling job, {record['date'][:10]}), against bf16:")
        for name, figures in compared.items():
            label = {"int8": "uncalibrated", "int8-calibrated": "calibrated"}.get(name, name.removeprefix("int8-"))
            lines.append(f"    {label}: {figures['speedup']:.2f}x bf16's speed, {figures['identical_share']:.0%} of "
                         f"greedy labels kept: {verdict(figures['speedup'])} on this CPU")
    for model, record in sorted(speed.items()):
        lines.append(f"  W8A8 speed on {model} ({record['workload']['name']}, {record['date'][:10]}), against "
                     f"bf16 (random weights: no labels to keep):")
        by_variant: dict[str, list[tuple[str, float]]] = {}
        for key, ratio in record["speedup"].items():
            variant, _, rows = key.partition(" / ")
            if variant != record.get("reference", "bf16"):
                by_variant.setdefault(variant.removeprefix("int8 "), []).append((rows, ratio))
        for variant, ratios in by_variant.items():
            each = ", ".join(f"{ratio:.2f}x on {rows}" for rows, ratio in ratios)
            lines.append(f"    {variant}: {each}: {verdict(min(ratio for _, ratio in ratios))} on this CPU")
    return ["precision: W8A8 measured on this CPU kind (quantization_calibration.activations):"] + lines


def verdict(speedup: float) -> str:
    return "pays" if speedup >= PAYS else "does not pay (bf16 is as fast or faster)"
