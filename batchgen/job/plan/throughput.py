"""A job's generation time, estimated from `batchgen bench` records (docs/performance-archive.jsonl) of the same
model on the same kind of machine: seconds per prompt token computed (not served by the prefix cache) and per
output token, fitted to the latest record of each bench workload."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.machine import machine_info
from batchgen.models.named import NAMED_MODELS


@dataclass(frozen=True)
class TimeEstimate:
    seconds: float | None  # generation, without the model load
    load_s: float | None
    how: str  # the rates used, or why there is no estimate
    records: tuple[str, ...] = ()
    probe: Any = None  # probe.ProbeResult, where the rates come from a probe instead of bench records
    probed: bool = False  # a probe started the engine (the weights loaded), whether or not it timed anything
    startup_s: float | None = None  # the command's own start before its engine (interpreter, imports, the job and
    #                                 input read): the plan process's, measured where the CLI gave its start

    @property
    def total_s(self) -> float:
        """Start-up, model load and generation: the command's wall time to expect."""
        return (self.startup_s or 0.0) + (self.load_s or 0.0) + (self.seconds or 0.0)


def estimate_time(archive: Path, model: str, device: dict[str, Any], prompt_tokens: float,
                  output_tokens: float, dtype: str = "float32") -> TimeEstimate:
    """`model`: a named model ("default") or a resolved path; `device`: {"type": "cpu", "cpu": name, "cores": n, "cpu_flags":
    machine_info's} or
    {"type": "cuda", ...}; `prompt_tokens`: those to compute, after the prefix cache; `dtype`: the run's, resolved
    ("float32"): only records of batchgen in that dtype count."""
    if not archive.is_file():
        return TimeEstimate(None, None, f"no bench archive at {archive}")
    if device["type"] != "cpu":
        return TimeEstimate(None, None, "no record for this model/device (bench records name no GPU)")
    latest: dict[str, dict] = {}  # workload name -> its latest matching record
    for line in archive.read_text().splitlines():
        record = json.loads(line) if line.strip() else None
        if record and _matches(record, model, device, dtype) and record["date"] >= latest.get(
                record["workload"]["name"], {}).get("date", ""):
            latest[record["workload"]["name"]] = record
    if not latest:
        flags = ", ".join(f for f, present in (device.get("cpu_flags") or {}).items() if present) or "flags unknown"
        return TimeEstimate(None, None, f"no record for this model/device/dtype ({device['cpu']}, {device['cores']} "
                                        f"cores, {flags}, {dtype}) in {archive}")
    records = sorted(latest.values(), key=lambda r: r["date"])
    names = tuple(_describe(r) for r in records)
    load_s = records[-1]["systems"]["batchgen"]["load_s"]
    work = np.array([[_computed_prompt(r), r["systems"]["batchgen"]["output_tokens"]] for r in records], float)
    wall = np.array([r["systems"]["batchgen"]["wall_s"] for r in records], float)
    if len(records) >= 2:
        (per_prompt, per_output), *_ = np.linalg.lstsq(work, wall, rcond=None)
        if per_prompt > 0 and per_output > 0:
            seconds = prompt_tokens * per_prompt + output_tokens * per_output
            how = (f"{per_prompt * 1e3:.2f} ms per prompt token computed, {per_output * 1e3:.2f} ms per output "
                   f"token, fitted to these")
            return TimeEstimate(seconds, load_s, how, names)
    per_token = wall[-1] / work[-1].sum()  # one record (or a fit that failed): one rate for every token
    return TimeEstimate((prompt_tokens + output_tokens) * per_token, load_s,
                        f"{per_token * 1e3:.2f} ms per token (prompt computed + output), from this", names[-1:])


def _matches(record: dict, model: str, device: dict[str, Any], dtype: str) -> bool:
    system = record.get("systems", {}).get("batchgen") or {}  # a roofline record has no systems
    if not system.get("available") or not system.get("wall_s"):
        return False
    recorded_dtype = record.get("config", {}).get("engine_args", {}).get("dtype", "auto")
    if (recorded_dtype if recorded_dtype != "auto" else "float32") != dtype:  # before --dtype: auto was fp32
        return False
    recorded = record["workload"].get("model")
    if recorded != model and (recorded in NAMED_MODELS or str(Path(str(recorded)).resolve()) != model):
        return False
    machine = record.get("machine", {})
    engine_device = record.get("config", {}).get("engine_args", {}).get("device", "auto")
    on_cpu = engine_device == "cpu" or (engine_device == "auto" and "+cpu" in machine.get("torch", ""))
    return on_cpu and same_cpu(machine, device)


def machine(device) -> dict[str, Any]:
    """This machine as the bench archive describes one: CPU model name, core count and kernel flags."""
    if device.type != "cpu":
        return {"type": device.type}
    info = machine_info()
    return {"type": "cpu", "cpu": info["cpu"], "cores": info["cores"], "cpu_flags": info["cpu_flags"]}


def same_cpu(machine: dict[str, Any], device: dict[str, Any]) -> bool:
    """A record's machine is this CPU kind: the same CPU name, core count and instruction sets."""
    return machine.get("cpu") == device.get("cpu") and machine.get("cores") == device.get("cores") \
        and _same_flags(machine.get("cpu_flags"), device.get("cpu_flags"))


def _same_flags(recorded: dict[str, bool] | None, current: dict[str, bool] | None) -> bool:
    """One CPU name covers machines with and without AVX-512 or AMX, whose speeds differ by multiples: the
    instruction sets a record lists must be this machine's (a record or a caller without them matches on name)."""
    if not recorded or not current:
        return True
    return all(recorded[flag] == current[flag] for flag in recorded.keys() & current.keys())


def _computed_prompt(record: dict) -> float:
    system = record["systems"]["batchgen"]
    return system["prompt_tokens"] * (1.0 - (system.get("prefix_cache_hit_rate") or 0.0))


def _describe(record: dict) -> str:
    return (f"{record['date'][:16].replace('T', ' ')} {record['workload']['name']} "
            f"({(record.get('git_commit') or '-')[:7]})")
