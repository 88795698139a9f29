"""The run: job -> executor (source -> engine) -> sink. `execute_job` streams the rows not yet committed through the
job's executor into the part writer, then finalizes the output and writes _SUCCESS with the run's summary."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from batchgen.engine import Result
from batchgen.engine.process_memory import peak_rss_bytes

from .config import ROW_SAMPLING_KEYS
from .executors import ExecutorRun, executor_for
from .output.final_formats import FinalFormat
from .output.final_rewrite import RowTotals, apply_rewrite, finalize
from .output.part_writer import PartWriter
from .output.parts import TIMELINE, final_part_schema
from .prepare import PreparedJob, check_input_unchanged, engine_target, fingerprint_text
from .report import JobReport
from .timeline import SAMPLE_INTERVAL_S, Timeline, parse_timeline

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Counters of the run in progress, for the progress bar, the progress log, the metrics and the timeline."""

    rows_total: int
    rows_done: int  # including rows committed by earlier runs
    started: float = field(default_factory=time.monotonic)
    generation_started: float | None = None  # once the model is loaded
    generation_finished: float | None = None  # once the executor returned (the last row's results in)
    kernel_build_s: float = 0.0  # of the model load: compiling the C++ CPU kernels (once per machine; 0 if cached)
    rows_this_run: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0  # of generated rows
    cached_tokens: int = 0
    error_rows: int = 0
    preemptions: int = 0  # of finished rows (engine_stats has the engines' own count)
    lane_stats: dict[str, dict] = field(default_factory=dict)  # each engine's last stats, by timeline lane
    stats_taken: dict[str, float] = field(default_factory=dict)
    timeline: Timeline | None = None

    def add(self, results: list[Result]) -> None:
        """One input row done: its result, or its samples'."""
        self.rows_done += 1
        self.rows_this_run += 1
        for result in results:
            self.output_tokens += result.output_tokens
            self.preemptions += result.num_preemptions
            if result.finish_reason != "error":
                self.prompt_tokens += result.prompt_tokens
                self.cached_tokens += result.cached_tokens
        self.error_rows += any(result.finish_reason == "error" for result in results)
        if self.timeline is not None:
            self.timeline.observe_job(self.rows_done, self.error_rows, self.output_tokens)

    def engine_sample(self, lane: str, stats: dict | Callable[[], dict], force: bool = False) -> None:
        """An engine's stats (Engine.stats(), or that method, called only if a sample is due): kept at most every
        SAMPLE_INTERVAL_S per lane, and offered to the timeline. Called between engine steps or rows, from the thread
        that calls add()."""
        now = time.monotonic()
        if not force and now - self.stats_taken.get(lane, float("-inf")) < SAMPLE_INTERVAL_S:
            return
        self.stats_taken[lane] = now
        self.lane_stats[lane] = stats() if callable(stats) else stats
        if self.timeline is not None:
            self.timeline.observe_engine(lane, self.lane_stats[lane], force=force)

    @property
    def engine_stats(self) -> dict:
        """The engine's last stats; with several (Ray replicas), their counts summed."""
        if len(self.lane_stats) <= 1:
            return next(iter(self.lane_stats.values()), {})
        lanes = list(self.lane_stats.values())
        summed = {key: sum(lane.get(key) or 0 for lane in lanes)
                  for key in ("num_preemptions", "kv_blocks_in_use", "kv_pool_blocks", "step_seconds_sum")}
        counts = [lane["step_seconds_counts"] for lane in lanes if lane.get("step_seconds_counts")]
        if counts:
            summed["step_seconds_counts"] = [sum(column) for column in zip(*counts)]
            summed["step_seconds_buckets"] = next(lane["step_seconds_buckets"] for lane in lanes
                                                  if lane.get("step_seconds_counts"))
        return summed

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def generation_s(self) -> float:
        """The job's own generation: from the model ready to the last row (0.0 when nothing was generated)."""
        if self.generation_started is None:
            return 0.0
        return (self.generation_finished or time.monotonic()) - self.generation_started

    @property
    def output_tokens_per_s(self) -> float:
        """Since the model finished loading."""
        since = self.generation_started or self.started
        return self.output_tokens / max(time.monotonic() - since, 1e-9)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def execute_job(job: PreparedJob, on_progress: Callable[[Progress], None] | None = None,
                on_start: Callable[[Progress], None] | None = None) -> dict:
    """Generate the rows not yet committed, then write the final output and _SUCCESS; returns the summary.
    On failure, every result received so far is committed before the exception propagates."""
    config, out = job.config, job.out
    try:
        if out.pending_rewrite() is not None:  # an earlier run crashed while moving its final parts into place
            return apply_rewrite(out)
        started_at = datetime.now(timezone.utc)
        done = job.done = job.done if job.done is not None else out.done_rows(job.inputs.total_rows)
        fingerprint = fingerprint_text(job.fingerprint)
        earlier = parse_timeline(out.read_text(TIMELINE), fingerprint)
        timeline = Timeline(earlier["runs"] if earlier else [], rows_at_start=done.count(1))
        progress = Progress(job.inputs.total_rows, done.count(1), timeline=timeline)
        save_timeline = lambda status: out.write_text(TIMELINE, json.dumps(timeline.to_json(fingerprint, status)))
        writer = PartWriter(out, job.schema, fingerprint, config.output.rows_per_part,
                            config.output.commit_interval_s, sort_by_row=config.output.order == "input",
                            json_type=job.options.json,
                            on_commit=lambda: save_timeline("running") if timeline.write_due() else None)
        run = ExecutorRun()

        def notify(results: list[Result]) -> None:
            progress.add(results)
            if on_progress:
                on_progress(progress)

        def started() -> None:
            progress.generation_started = time.monotonic()
            timeline.observe_job(progress.rows_done, progress.error_rows, progress.output_tokens, force=True)
            if on_start:
                on_start(progress)

        try:
            if progress.rows_done < progress.rows_total:
                row_keys = [key for key in ROW_SAMPLING_KEYS if key in job.inputs.column_types] \
                    if config.task == "generate" else []  # the other tasks read no sampling columns
                if row_keys:  # a column named `n` or `choice` is easily someone's data: say what it does here
                    log.info("input columns that set sampling per row: %s", ", ".join(row_keys))
                built = kernel_build_seconds()
                run = executor_for(config.executor.kind).run(job, writer, notify, started, progress.engine_sample)
                progress.generation_finished = time.monotonic()
                progress.kernel_build_s = kernel_build_seconds() - built
                for lane, stats in run.final_stats().items():  # the final ones, for metrics and the timeline
                    progress.engine_sample(lane, stats, force=True)
            timeline.observe_job(progress.rows_done, progress.error_rows, progress.output_tokens, force=True)
        except BaseException:
            _commit_quietly(writer.commit, lambda: save_timeline("failed"))
            raise
        writer.commit()
        check_input_unchanged(job)
        final_timeline = timeline.to_json(fingerprint, "finished")  # one reading: the file and the page agree
        out.write_text(TIMELINE, json.dumps(final_timeline))
        summarize = lambda totals: build_summary(job, totals, progress, run, started_at)
        report = JobReport(out.path, final_timeline) if config.output.report else None
        fmt = FinalFormat(config.output.format, model=config.model, chat=bool(config.input.chat_template))
        return finalize(out, final_part_schema(job.schema, fingerprint), job.inputs.total_rows,
                        config.output.order, config.output.rows_per_part, summarize, report, fmt)
    finally:
        job.release()


def kernel_build_seconds() -> float:
    """Seconds this process has spent compiling the C++ CPU kernels (cpu_build.py): a machine's first run only."""
    from batchgen_kernels.cpu_build import build_seconds

    return build_seconds()


def _commit_quietly(*steps: Callable[[], None]) -> None:
    for step in steps:
        try:
            step()
        except Exception:
            pass  # the original failure is the one to report


# What a run may hold beyond its weights and the KV blocks it used: python, torch and the other modules, the tokenizer,
# the sort window, a step's activations. Peak RSS above weights + used KV + this is worth a look.
MEMORY_OVERHEAD_BOUND = 2**30


def memory_bound(engine_stats: dict) -> int | None:
    """weights + the KV blocks ever used (the resident part of the pool) + MEMORY_OVERHEAD_BOUND; None when the
    engine did not run in this process."""
    if "weights_bytes" not in engine_stats:
        return None
    return engine_stats["weights_bytes"] + engine_stats["kv_bytes_touched"] + MEMORY_OVERHEAD_BOUND


def build_summary(job: PreparedJob, totals: RowTotals, progress: Progress, run: ExecutorRun,
                  started_at: datetime) -> dict:
    import torch

    engine_stats = run.engine_stats
    wall_s = progress.elapsed_s
    peak = max(engine_stats.get("peak_memory_bytes", 0), peak_rss_bytes())
    # The engine reports its dtype and why (its plan); where no engine ran here, the job's resolved target says it.
    target = None if {"dtype", "dtype_reason"} <= engine_stats.keys() else job.target or engine_target(job.config)
    from batchgen.machine import machine_info
    from batchgen.versions import library_versions

    from .calibration import job_calibration
    summary = {
        "rows": totals.rows,
        "output_rows": totals.output_rows,
        "rows_ok": totals.rows_ok,
        "rows_error": totals.rows_error,
        "prompt_tokens": totals.prompt_tokens,
        "output_tokens": totals.output_tokens,
        "cached_tokens": totals.cached_tokens,
        "generated_prompt_tokens": totals.generated_prompt_tokens,  # what prefix_cache_hit_rate is a share of
        "prefix_cache_hit_rate": totals.cached_tokens / totals.generated_prompt_tokens
        if totals.generated_prompt_tokens else 0.0,
        "preemptions": totals.preemptions,
        "wall_s": wall_s,
        "generation_s": progress.generation_s,  # from the model ready to the last row
        "kernel_build_s": progress.kernel_build_s,  # of the wall time: the C++ CPU kernels compiled (0.0: cached)
        "output_tokens_per_s": progress.output_tokens / progress.generation_s if progress.generation_s > 0 else 0.0,
        "cost_per_hour": job.cost_per_hour,
        "tokens_per_dollar": progress.output_tokens / (wall_s / 3600 * job.cost_per_hour)
        if job.cost_per_hour and wall_s > 0 else None,
        "rows_this_run": progress.rows_this_run,
        "resumed": progress.rows_this_run < totals.rows,
        "peak_memory_bytes": peak,
        "memory_bound_bytes": memory_bound(engine_stats),
        "model": job.fingerprint["model"],  # as the fingerprint pins it: a hub id with its commit
        # the LoRA adapters as the fingerprint pins them (name -> source and digest)
        **({"lora": job.fingerprint["lora"]} if "lora" in job.fingerprint else {}),
        "task": job.config.task,
        **task_summary(job, totals),
        "dtype": engine_stats["dtype"] if target is None else target.dtype.name,
        "dtype_reason": engine_stats["dtype_reason"] if target is None else target.dtype.reason,
        "started_at": started_at.isoformat(),
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "engine_stats": engine_stats,
        "job": job.config.to_dict(),
        "fingerprint": job.fingerprint,
        "versions": library_versions(),
        "machine": machine_info(),
    }
    if (calibration := job_calibration(job)) is not None:  # quantization_calibration: rows, layers kept, why
        summary["quantization_calibration"] = calibration
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        summary["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
    if run.replicas is not None:  # a Ray run: what each replica did (its rows, tokens, wall time and engine)
        summary["replicas"] = run.replicas
    return summary


def task_summary(job: PreparedJob, totals: RowTotals) -> dict:
    """What a prefill-only task's _SUCCESS adds: embed the embedding's dimension and the rows truncated, classify the
    model's labels in their order (the `probs` columns' order), score the tokens scored over all rows."""
    task = job.config.task
    if task == "embed":
        return {"embedding_dimensions": totals.embedding_dimensions, "truncated_rows": totals.truncated_rows}
    if task == "classify":
        return {"labels": model_labels(job.model), "truncated_rows": totals.truncated_rows}
    if task == "score":
        return {"scored_tokens": totals.scored_tokens}
    return {}


def model_labels(model: str) -> list[str]:
    """A classifier's labels in id order, as transformers reads them from its config (LABEL_0, ... by default)."""
    from transformers import AutoConfig

    from batchgen.models.loader import engine_model_dir

    id2label = AutoConfig.from_pretrained(str(engine_model_dir(model, "classify"))).id2label
    return [id2label[i] for i in sorted(id2label)]


def prompt_tokens_line(summary: dict) -> str:
    """The summary's prompt tokens, and the prefix cache's share of those of the rows generated: an error row's
    prompt tokens (a prompt too long for the context) were never the prefix cache's to serve."""
    total = summary["prompt_tokens"]
    generated = summary.get("generated_prompt_tokens", total)  # a _SUCCESS written before it was kept
    cached = f"{summary['cached_tokens']:,} from the prefix cache, {summary['prefix_cache_hit_rate']:.1%}"
    if generated == total:
        return f"{total:,} ({cached})"
    return f"{generated:,} of the rows generated ({cached}), {total - generated:,} of error rows"
