"""One benchmark run of a prefill-only workload (`--workload embed | classify | score`): the texts, the engine
settings with the task, every system on the same rows one after another in this process (vLLM in its worker), the
agreement with batchgen, then the JSON record, the chart and the archive line, as harness.py does for generation.

The model: embed defaults to all-minilm-l6-v2 and score to the default model; classify needs --model (a
sequence-classification checkpoint; dev/make_random_classifier.py makes random ones)."""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from batchgen.machine import machine_info

from . import ceiling
from .run_common import BenchResult, git_commit, resolved_dtype
from .system_types import BenchOptions, SystemRun
from .systems import TASK_SYSTEMS, run_system
from .task_report import archive_entry, task_comparisons, task_figures, task_row_records, write_task_chart
from .task_workloads import TextWorkload, encoder_max_length, text_workload

DEFAULT_MODELS = {"embed": "all-minilm-l6-v2", "score": "default"}


def build_text_workload(config) -> tuple[TextWorkload, Any]:
    """The rows, and batchgen's engine settings: the task, --dtype (default float32), --max-num-seqs."""
    from batchgen.engine import EngineArgs
    from batchgen.models.loader import load_tokenizer, reference_model_dir, resolve_model

    task = config.workload
    if config.job:
        raise ValueError(f"--workload {task} builds its own rows; a JOB.yaml is for generation")
    generation_only = [option for option, value in (("--ignore-eos", config.ignore_eos),
                                                    ("--max-tokens", config.max_tokens),
                                                    ("--quantization", config.quantization),
                                                    ("--model-impl", config.model_impl)) if value]
    if generation_only:
        raise ValueError(f"{generation_only[0]}: does not apply to --workload {task} (the baselines run the "
                         f"model as it is, prefill only)")
    model = config.model or DEFAULT_MODELS.get(task)
    if model is None:
        raise ValueError(f"--workload {task} needs --model: a sequence-classification model (a directory, or one "
                         f"made by dev/make_random_classifier.py)")
    overrides = {key: value for key, value in (("max_num_seqs", config.max_num_seqs),
                                               ("kv_cache_memory", config.kv_cache_memory)) if value is not None}
    # Every system runs the same weights: a GGUF's fp32 conversion (the default model's), which the baselines load,
    # not the int8 one batchgen's engine would hold (whose log-likelihoods differ by about 3%).
    reference = str(reference_model_dir(model))
    same_weights = reference == str(resolve_model(model))
    engine_args = EngineArgs(model=model if same_weights else reference, task=task, **overrides)
    engine_args.validate()
    engine_args = dataclasses.replace(engine_args, dtype=resolved_dtype(config.dtype or "float32",
                                                                        engine_args.device))
    model_dir = resolve_model(model)
    tokenizer = load_tokenizer(model_dir)
    max_length = None if task == "score" else encoder_max_length(model_dir, tokenizer)
    workload = text_workload(task, config.rows or 200, config.seed, tokenizer, model, max_length)
    if not same_weights:
        workload.notes.append(f"every system runs {model}'s fp32 conversion ({reference}), batchgen too")
    return workload, engine_args


def length_mix(described: dict) -> str:
    return ", ".join(f"{count} {kind}" for kind, count in described["rows_by_length"].items())


def run_task_bench(config, log: Callable[[str], None] = print):
    started_at = datetime.now(timezone.utc)
    commit = git_commit()
    workload, engine_args = build_text_workload(config)
    task = workload.name
    described = workload.describe()
    log(f"bench: workload {task}: {len(workload.rows)} rows ({length_mix(described)}), "
        f"{workload.prompt_tokens:,} tokens run" + (f" ({described['rows_truncated']} rows cut to "
                                                      f"{workload.max_length})" if workload.max_length else ""))
    dtype = engine_args.dtype
    hf_dtype = resolved_dtype(config.hf_dtype, engine_args.device) if config.hf_dtype else dtype
    machine_ceiling = ceiling.matmul_flops(config.ceiling_n, dtype=dtype)
    options = BenchOptions(engine_args, tuple(config.hf_batch_sizes), config.vllm_python,
                           config.hf_continuous_time_limit_s, dtype, hf_dtype, config.vllm_threads_bind)
    runs: dict[str, SystemRun] = {}
    for name in dict.fromkeys(config.systems):
        log(f"bench: running {name}")
        runs[name] = run_system(name, workload.rows, options, TASK_SYSTEMS[task])
        run = runs[name]
        log(f"bench: {name}: " + (f"load {run.load_s:.1f} s, {task} {run.wall_s:.2f} s" if run.available
                                  else f"unavailable: {run.reason}"))

    record = {
        "task": task, "date": started_at.isoformat(), "git_commit": commit, "machine": machine_info(),
        "config": {**dataclasses.asdict(config), "engine_args": dataclasses.asdict(engine_args)},
        "workload": described, "ceiling": machine_ceiling,
        "reference": "batchgen" if runs.get("batchgen") and runs["batchgen"].available else None,
        "systems": {name: task_figures(run, workload) for name, run in runs.items()},
        "comparisons": task_comparisons(task, runs),
        "rows": {name: task_row_records(task, run) for name, run in runs.items() if run.available},
    }
    stamp = started_at.strftime("%Y%m%d-%H%M%S")
    record_path = Path(config.out_dir) / f"bench-{task}-{stamp}.json"
    chart_path = record_path.with_suffix(".png")
    archive_path = Path(config.archive)
    record_path.parent.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    write_task_chart(record, chart_path)
    archive_path.parent.mkdir(parents=True, exist_ok=True)
    with open(archive_path, "a") as f:
        f.write(json.dumps(archive_entry(record)) + "\n")
    return BenchResult(record, record_path, chart_path, archive_path, runs)
