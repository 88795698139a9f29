"""Whether calibrated W8A8 (`quantization: int8` with `quantization_calibration`) pays on this kind of CPU, from the
latest `dev/w8a8_figures.py` record (kind w8a8-calibrated) of the same CPU name, core count and instruction sets in
the bench archive: its generation time against bf16 on the labeling job, and how many labels it kept, per model
measured. W8A8 multiplies int8 x int8 (oneDNN, VNNI/AMX where the CPU has them), but quantizes every token's
activations on the way in and rescales on the way out, and the layers the calibration keeps run in the dtype: where
bf16 already runs on AMX tiles, that overhead can cost more than the int8 multiplications save."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .throughput import same_cpu

KIND = "w8a8-calibrated"
PAYS = 1.05  # said to pay only past this speed ratio: the runs' spread on a shared 2-core machine is a few %


def calibrated_w8a8_advice(archive: Path, device: dict[str, Any], quantization: str | None) -> list[str]:
    """The plan's lines for a job with quantization int8: each model's latest record on this CPU kind."""
    if quantization != "int8" or device.get("type") != "cpu" or not archive.is_file():
        return []
    latest: dict[str, dict] = {}
    for line in archive.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") == KIND and same_cpu(record.get("machine", {}), device):
            model = record["workload"]["model"]
            if record["date"] >= latest.get(model, {}).get("date", ""):
                latest[model] = record
    if not latest:  # nothing measured here: the roofline advice above says how to measure
        return []
    lines = []
    for model, record in sorted(latest.items()):
        compared = record["comparisons"]
        cal, raw = compared["int8-calibrated"], compared["int8"]
        verdict = "pays" if cal["speedup"] >= PAYS else "does not pay (bf16 is as fast or faster)"
        lines.append(f"  calibrated W8A8 on {model} (labeling job, {record['date'][:10]}): {cal['speedup']:.2f}x "
                     f"bf16's speed, {cal['identical_share']:.0%} of greedy labels kept (uncalibrated "
                     f"{raw['speedup']:.2f}x, {raw['identical_share']:.0%}): {verdict} on this CPU")
    return ["precision: calibrated W8A8 measured on this CPU kind:"] + lines
