"""One benchmark run: build the workload, measure the machine's ceiling, run every system on the same rows one
after another in this process, then compare, and write the JSON record, the chart and the archive line."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from batchgen.machine import machine_info

from . import ceiling, report
from .run_common import BenchResult, git_commit, resolved_dtype
from .system_types import DTYPES, BenchOptions, SystemRun
from .systems import SYSTEMS, TASK_SYSTEMS, run_system
from .workload_realistic import realistic_workload
from .workloads import Workload, fixed_max_tokens, job_workload, synthetic_workload

MODEL_AND_JOB = "--model: a JOB.yaml names its own model (its `model:` key); give one or the other"


@dataclass
class BenchConfig:
    job: str | None = None  # a job file: its rows instead of a synthetic workload
    workload: str = "generation"  # or a prefill-only task: embed | classify | score (task_harness.py)
    rows: int | None = None  # default: 200 synthetic rows, or every row of the job
    seed: int = 0
    systems: tuple[str, ...] = ("batchgen", "batchgen-nocache", "hf-static", "hf-continuous", "vllm")
    hf_batch_sizes: tuple[int, ...] = (16, 32)
    vllm_python: str | None = None
    out_dir: str = "bench-results"
    archive: str = "docs/performance-archive.jsonl"  # committed: one line per run, so regressions show
    max_num_seqs: int | None = None
    kv_cache_memory: str | None = None
    max_tokens_scale: float = 1.0  # for quick runs (tests): every row's max_tokens times this
    hf_continuous_time_limit_s: float = 1800.0
    ceiling_n: int = 2048
    bandwidth_bytes: int = 2**30  # the memory-bandwidth probe's buffer (ceiling.memory_bandwidth)
    dtype: str | None = None  # batchgen's and vLLM's; default float32 (with a job: the job's dtype)
    hf_dtype: str | None = None  # the transformers baselines'; default: the same as dtype
    vllm_threads_bind: str = "all"  # VLLM_CPU_OMP_THREADS_BIND: all (this process's CPUs) | default | a CPU list
    model: str | None = None  # a directory, .gguf or named model; default: the default model (a job names its own)
    ignore_eos: bool = False  # fixed length: every row generates exactly its max_tokens, EOS or not
    max_tokens: int | None = None  # every row's max_tokens; default: the workload's own (times max_tokens_scale)
    quantization: str | None = None  # batchgen's engine quantization; vLLM runs the nearest it has (vllm_system.py)
    model_impl: str | None = None  # batchgen's engine model_impl (native or transformers' code: the generic path)

    def validate(self) -> None:
        known = tuple(TASK_SYSTEMS.get(self.workload, SYSTEMS))
        unknown = [name for name in self.systems if name not in known]
        if unknown or not self.systems:
            raise ValueError(f"--systems: unknown {', '.join(unknown) or '(none given)'}"
                             + (f" for --workload {self.workload}" if self.workload in TASK_SYSTEMS else "")
                             + f"; choose from {', '.join(known)}")
        if not self.hf_batch_sizes or any(size < 1 for size in self.hf_batch_sizes):
            raise ValueError(f"--hf-batch-sizes must be positive integers, got {self.hf_batch_sizes}")
        if self.rows is not None and self.rows < 1:
            raise ValueError(f"--rows must be at least 1, got {self.rows}")
        if self.max_tokens_scale <= 0:
            raise ValueError(f"--max-tokens-scale must be positive, got {self.max_tokens_scale}")
        for option, value in (("--dtype", self.dtype), ("--hf-dtype", self.hf_dtype)):
            if value is not None and value not in DTYPES:
                raise ValueError(f"{option} must be one of {', '.join(DTYPES)}, got {value!r}")
        if not self.vllm_threads_bind.strip():
            raise ValueError("--vllm-threads-bind must be all, default or a CPU list such as 0-3")
        if self.job and self.model:
            raise ValueError(MODEL_AND_JOB)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        check_quantization_name(self.quantization)


def run_bench(config: BenchConfig, log: Callable[[str], None] = print) -> BenchResult:
    config.validate()
    if config.workload in TASK_SYSTEMS:  # embed, classify, score: prefill only, rows of plain text
        from .task_harness import run_task_bench
        return run_task_bench(config, log)
    started_at = datetime.now(timezone.utc)
    commit = git_commit()  # the code that runs is the code at the start, whatever is committed meanwhile
    workload, engine_args = build_workload(config)
    log(f"bench: workload {workload.name}: {len(workload.rows)} rows, {workload.prompt_tokens:,} prompt tokens, "
        + (f"exactly {workload.max_output_tokens:,} output tokens (ignore_eos)" if config.ignore_eos
           else f"up to {workload.max_output_tokens:,} output tokens"))
    dtype = engine_args.dtype  # resolved by build_workload
    hf_dtype = resolved_dtype(config.hf_dtype, engine_args.device) if config.hf_dtype else dtype
    log(f"bench: dtype {dtype} (transformers baselines: {hf_dtype}); measuring the machine's {dtype} matmul ceiling")
    machine_ceiling = ceiling.matmul_flops(config.ceiling_n, dtype=dtype)
    bandwidth = ceiling.memory_bandwidth(config.bandwidth_bytes)

    options = BenchOptions(engine_args, tuple(config.hf_batch_sizes), config.vllm_python,
                           config.hf_continuous_time_limit_s, dtype, hf_dtype, config.vllm_threads_bind,
                           config.ignore_eos)
    runs: dict[str, SystemRun] = {}
    for name in dict.fromkeys(config.systems):
        log(f"bench: running {name}" + (f" (batch sizes {', '.join(map(str, options.hf_batch_sizes))}, each a "
                                        f"full run)" if name == "hf-static" else ""))
        runs[name] = run_system(name, workload.rows, options)
        run = runs[name]
        started = "" if run.startup_s is None else f"start-up {run.startup_s:.1f} s (a fresh process), "
        log(f"bench: {name}: " + (f"{started}load {run.load_s:.1f} s, generation {run.wall_s:.1f} s" if run.available
                                  else f"unavailable: {run.reason}"))

    record = build_record(config, workload, engine_args, machine_ceiling, runs, started_at, commit, bandwidth)
    stamp = started_at.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(config.out_dir)
    record_path = out_dir / f"bench-{workload.name.replace(':', '-')}-{stamp}.json"
    chart_path = record_path.with_suffix(".png")
    archive_path = Path(config.archive)
    report.write_record(record, record_path)
    report.write_chart(record, chart_path)
    report.append_archive(record, archive_path)
    return BenchResult(record, record_path, chart_path, archive_path, runs)


def build_workload(config: BenchConfig) -> tuple[Workload, Any]:
    """The rows, and the engine settings for batchgen (the job's engine section when there is a job)."""
    from batchgen.engine import EngineArgs
    from batchgen.engine.engine_plan import resolve_target
    from batchgen.models.loader import load_tokenizer, resolve_model

    if config.job:
        from batchgen.job.config import load_job

        engine_args = load_job(config.job).engine
    else:
        engine_args = EngineArgs(model=config.model or "default")
    overrides = {key: value for key, value in (("max_num_seqs", config.max_num_seqs),
                                               ("kv_cache_memory", config.kv_cache_memory),
                                               ("quantization", config.quantization),
                                               ("model_impl", config.model_impl)) if value is not None}
    engine_args = dataclasses.replace(engine_args, **overrides)
    engine_args.validate()
    # One explicit dtype for batchgen and vLLM, recorded as such: --dtype, else the job's, else float32.
    dtype = config.dtype or (engine_args.dtype if config.job else "float32")
    engine_args = dataclasses.replace(engine_args, dtype=resolved_dtype(dtype, engine_args.device))
    resolve_target(engine_args.device, engine_args.dtype, engine_args.quantization)  # the engine's verdict, now
    tokenizer = load_tokenizer(resolve_model(engine_args.model))
    if config.job:
        workload = job_workload(config.job, tokenizer, config.rows, config.max_tokens_scale)
    elif config.workload == "realistic":
        workload = realistic_workload(config.rows or 200, config.seed, tokenizer, engine_args.model,
                                      config.max_tokens_scale)
    else:
        workload = synthetic_workload(config.workload, config.rows or 200, config.seed, tokenizer,
                                      engine_args.model, config.max_tokens_scale)
    if config.max_tokens is not None:
        workload = fixed_max_tokens(workload, config.max_tokens)
    return workload, engine_args


def check_quantization_name(name: str | None) -> None:
    from batchgen.engine.engine_args import QUANTIZATIONS

    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")


def decoder_for(engine_args: Any, runs: dict[str, SystemRun]) -> Callable[[list[int]], str] | None:
    """Token ids to text, for comparing a labeling system's labels with free answers; None when none ran."""
    if not any("label_token_ids" in run.details for run in runs.values()):
        return None
    from batchgen.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(engine_args.model))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def build_record(config: BenchConfig, workload: Workload, engine_args: Any, machine_ceiling: dict,
                 runs: dict[str, SystemRun], started_at: datetime, commit: str | None,
                 bandwidth: dict | None = None) -> dict[str, Any]:
    reference = report.reference_of(runs)
    record = {
        "date": started_at.isoformat(),
        "git_commit": commit,
        "machine": machine_info(),
        "config": {**dataclasses.asdict(config), "engine_args": dataclasses.asdict(engine_args)},
        "workload": workload.describe(),
        "ceiling": machine_ceiling,
        "reference": reference,
        "systems": {name: report.system_figures(run, workload) for name, run in runs.items()},
        "comparisons": report.comparisons(runs, decoder_for(engine_args, runs)),
        "decode": None,
        "bandwidth": bandwidth,
        "phases": phases_of(workload, engine_args, runs, machine_ceiling, bandwidth),
        "rows": {name: report.row_records(run) for name, run in runs.items() if run.available},
    }
    if reference is not None:
        ref = runs[reference]
        output_tokens = sum(len(row.token_ids) for row in ref.rows)
        record["decode"] = ceiling.decode_share(ref.details["parameters"], output_tokens, ref.wall_s,
                                                machine_ceiling["flops"])
    return record


def phases_of(workload: Workload, engine_args: Any, runs: dict[str, SystemRun], machine_ceiling: dict,
              bandwidth: dict | None) -> dict[str, Any] | None:
    """Each system's prefill and decode against the roofline (phase_report.py); None without a bandwidth, or for a
    quantized run or model (the floor is the unquantized model's)."""
    from .phase_report import model_counts, phase_record

    if bandwidth is None or engine_args.quantization is not None:
        return None
    counts = model_counts(engine_args.model, engine_args.dtype)
    if counts is None:
        return None
    return phase_record(workload, runs, counts, bandwidth["bytes_per_s"], machine_ceiling["flops"])
