"""Glue: job -> source -> engine -> sink. `prepare_job` does every check that needs no model (job-level problems
raise JobConfigError); `execute_job` loads the model, streams the remaining rows and finalizes the output."""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa

import batchgen
from batchgen.engine import EngineArgs, Request, Result, SamplingParams
from batchgen.engine.engine_args import parse_bytes
from batchgen.engine.process_memory import peak_rss_bytes
from batchgen.engine.errors import SettingError

from .config import ROW_SAMPLING_KEYS, JobConfig, JobConfigError, setting_error
from .resume import check_output, describe_changes, input_identity, output_errors
from .schema import ROW_POSITION_ID_TYPE, OutputOptions, output_schema
from .final_rewrite import RowTotals, apply_plan, finalize
from .sink import OutputDir, PartWriter, final_part_schema, run_part_schema
from .inputs import InputFiles, inspect_input
from .source import SourceRow, read_source

log = logging.getLogger(__name__)

# The parts of a job that change its results: a resume is refused when any of them differs.
PROMPT_KEYS = ("id_column", "prompt_column", "messages_column", "system_prompt", "system_column", "template",
               "chat_template", "allow_special_tokens")


@dataclass
class PreparedJob:
    config: JobConfig
    inputs: InputFiles
    fingerprint: dict[str, Any]
    out: OutputDir
    complete: dict | None = None  # the _SUCCESS summary when the job already finished
    lock_fd: int | None = None
    done: bytearray | None = None  # the ledger read when the output was taken: done[row] for committed rows
    cost_per_hour: float | None = None  # the machine's price, for _SUCCESS's tokens_per_dollar

    @property
    def options(self) -> OutputOptions:
        return OutputOptions.of(self.config, self.inputs.column_types)

    @property
    def schema(self) -> pa.Schema:
        types = self.inputs.column_types
        id_type = types[self.config.input.id_column] if self.config.input.id_column else ROW_POSITION_ID_TYPE
        return output_schema(id_type, [(c, types[c]) for c in self.config.output.keep_columns], self.options)

    @property
    def run_schema(self) -> pa.Schema:
        return run_part_schema(self.schema, fingerprint_text(self.fingerprint))

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

    def add(self, results: list[Result]) -> None:
        """One input row done: its result, or its samples'."""
        self.rows_done += 1
        self.rows_this_run += 1
        for result in results:
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
    """Every check that needs no model: inspect_job's, and what the output directory holds. Takes the output's lock
    unless the job is already complete."""
    job = inspect_job(config)
    with output_errors(job.out):
        job.complete = check_output(job.out, job.fingerprint, overwrite, job.run_schema)
        if job.complete is None:
            take_output(job, overwrite)
    return job


def inspect_job(config: JobConfig) -> PreparedJob:
    """The read-only checks that need no model (`batchgen plan` runs them too): input files and columns, model
    location, device and memory (the engine settings were validated with the job)."""
    inputs = inspect_input(config)
    check_executor(config)
    model = check_model(config.model)
    check_device(config.device)
    check_kv_cache_memory(config.engine)
    return PreparedJob(config, inputs, job_fingerprint(config, model, inputs), OutputDir(config.output.path))


def check_chat_template(config: JobConfig, tokenizer) -> None:
    if config.input.chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise JobConfigError(f"input.chat_template: model {config.model} has no chat template; "
                             f"set input.chat_template: false")


def check_executor(config: JobConfig) -> None:
    """executor.kind: ray needs Ray Data, an optional extra."""
    if config.executor.kind == "ray":
        try:
            import ray.data  # noqa: F401
        except ImportError:
            raise JobConfigError("executor.kind: ray needs Ray, which is not installed: pip install -e \".[ray]\" "
                                 "in batchgen's checkout (scripts/setup.sh installs it)") from None


def check_model(ref: str) -> str:
    """Where the model is, checked cheaply (no loading, no conversion): what identifies it in the fingerprint."""
    from batchgen.models.loader import ModelError, locate_model

    try:
        path = locate_model(ref)
    except ModelError as exc:
        raise JobConfigError(f"model: {exc}") from None
    return "default" if ref == "default" else str(path.resolve())


def check_device(device: str) -> None:
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise JobConfigError("device: cuda was asked for but torch sees no CUDA device (use auto or cpu)")


def check_kv_cache_memory(engine: EngineArgs) -> None:
    """A KV cache larger than the machine would fail in the allocator, after the model loaded: refuse it now. On
    CUDA only a size that was set is checked, against the device's memory (the default is sized from it)."""
    import torch

    if engine.device == "cuda" or (engine.device == "auto" and torch.cuda.is_available()):
        if engine.kv_cache_memory is None:
            return
        limit, where = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, "the GPU's memory"
    else:
        import psutil
        limit, where = psutil.virtual_memory().available, "the memory available on this machine"
    size = parse_bytes(engine.cpu_kv_cache_memory())
    if size > limit:
        shown = "the default, " if engine.kv_cache_memory is None else ""
        raise JobConfigError(f"engine.kv_cache_memory: {engine.cpu_kv_cache_memory()!r} ({shown}{size / 2**30:,.1f} "
                             f"GiB) is more than {where} ({limit / 2**30:,.1f} GiB); set a smaller size")


def job_fingerprint(config: JobConfig, model: str, inputs: InputFiles) -> dict[str, Any]:
    """What decides the rows' results (engine settings other than quantization, and sorting, do not), the identity
    of each input file included: a rewritten input is another job. The dtype is the one `auto` resolves to here:
    resuming on a machine where it resolves to another would mix rows of both."""
    return {
        "model": model,
        "dtype": resolved_dtype(config).name,
        "input": {key: getattr(config.input, key) for key in PROMPT_KEYS},
        "files": input_files(inputs),
        "sampling": config.to_dict()["sampling"],
        "keep_columns": list(config.output.keep_columns),
        # int8 weights change the results; absent when off, so outputs written before the setting still resume
        **({"quantization": config.engine.quantization} if config.engine.quantization else {}),
        # a shorter context cuts rows short (finish_reason length); absent when unset, for the same reason
        **({"max_model_len": config.engine.max_model_len} if config.engine.max_model_len else {}),
    }


def resolved_dtype(config: JobConfig):
    """The run's dtype and why (a cpu_features.DtypeChoice): the engine's own rule, which needs no model."""
    from batchgen.engine.startup import resolve_device, resolve_dtype

    return resolve_dtype(config.dtype, resolve_device(config.device))


def input_files(inputs: InputFiles) -> list[dict[str, Any]]:
    return [{"path": str(path.resolve()), "rows": rows, **input_identity(path)}
            for path, rows in zip(inputs.files, inputs.row_counts)]


def fingerprint_text(fingerprint: dict[str, Any]) -> str:
    return json.dumps(fingerprint, sort_keys=True)


def take_output(job: PreparedJob, overwrite: bool) -> None:
    """Lock the output, clear it (--overwrite) and read what earlier runs committed. The output is checked again
    once locked: a run that held the lock may have finished it (or committed more) since the first check."""
    job.lock_fd = lock_output(job.out)
    try:
        job.complete = check_output(job.out, job.fingerprint, overwrite, job.run_schema)
        if job.complete is not None:  # finished by the run that held the lock: leave no temp directory behind
            shutil.rmtree(job.out.tmp, ignore_errors=True)  # while locked, so that no other run holds this lock
            job.release()
            return
        if overwrite:
            job.out.remove_outputs()
        if job.out.pending_plan() is None:
            job.done = job.out.done_rows(job.inputs.total_rows)
    except BaseException:
        job.release()
        raise


def lock_output(out: OutputDir) -> int:
    """One run per output at a time (a cron overlap must not interleave parts). The lock dies with the process."""
    out.path.mkdir(parents=True, exist_ok=True)
    fd = _locked_file(out)
    try:
        with tempfile.TemporaryFile(dir=out.path, prefix=".batchgen-probe-"):
            pass  # a read-only output directory fails now, not at the first commit
        out.prepare_tmp()
    except BaseException:
        os.close(fd)
        raise
    return fd


def _locked_file(out: OutputDir) -> int:
    """The lock file, opened and locked. A run that finishes removes the temp directory with the lock in it: a
    lock taken on that removed file would lock nothing, so the file locked must still be the one at the path."""
    path = out.tmp / "lock"
    for _ in range(10):
        out.make_tmp()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except BlockingIOError:
            os.close(fd)
            raise JobConfigError(f"output.path: another batchgen run is writing {out.path}") from None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed or replaced after we opened it: open the one there now
    raise JobConfigError(f"output.path: the lock file {path} keeps being replaced; is another batchgen run "
                         f"starting and finishing on {out.path}?")


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
        done = job.done = job.done if job.done is not None else out.done_rows(job.inputs.total_rows)
        progress = Progress(job.inputs.total_rows, done.count(1))
        writer = PartWriter(out, job.schema, fingerprint_text(job.fingerprint), config.output.rows_per_part,
                            config.output.commit_interval_s, sort_by_row=config.output.order == "input",
                            json_type=job.options.json)
        engine_stats: dict = {}
        replicas: dict | None = None

        def notify(results: list[Result]) -> None:
            progress.add(results)
            if on_progress:
                on_progress(progress)

        try:
            if progress.rows_done < progress.rows_total:
                row_keys = [key for key in ROW_SAMPLING_KEYS if key in job.inputs.column_types]
                if row_keys:  # a column named `n` or `choice` is easily someone's data: say what it does here
                    log.info("input columns that set sampling per row: %s", ", ".join(row_keys))
                if config.executor.kind == "ray":
                    replicas = run_ray(job, writer, notify, progress, on_start)
                else:
                    engine = load_engine(job)
                    progress.generation_started = time.monotonic()
                    if on_start:
                        on_start(progress)
                    rows = read_source(config, job.inputs, engine.tokenizer, engine.max_model_len, done,
                                       context_limit=engine.context_limit)
                    stream_rows(rows, engine.generate, writer, notify, json_schema=config.sampling.json_schema)
                    engine_stats = engine.stats()
        except BaseException:
            _commit_quietly(writer)
            raise
        writer.commit()
        check_input_unchanged(job)
        summarize = lambda totals: build_summary(job, totals, progress, engine_stats, started_at, replicas)
        return finalize(out, final_part_schema(job.schema, fingerprint_text(job.fingerprint)), job.inputs.total_rows,
                        config.output.order, config.output.rows_per_part, summarize)
    finally:
        job.release()


def run_ray(job: PreparedJob, writer: PartWriter, notify: Callable[[list[Result]], None], progress: Progress,
            on_start: Callable[[Progress], None] | None) -> dict:
    """The rows left on Ray replicas (ray_executor.py); the driver writes them. Returns the per-replica totals."""
    from batchgen.models.loader import load_tokenizer, resolve_model

    from .ray_executor import run_on_ray

    config = job.config
    check_chat_template(config, load_tokenizer(resolve_model(config.model)))
    progress.generation_started = time.monotonic()
    if on_start:
        on_start(progress)

    def write(row: int, ident: Any, keep: tuple, results: list[Result], parse_json: bool, replica: int) -> None:
        writer.add(row, ident, keep, *results, parse_json=parse_json, replica=replica)
        notify(results)

    return run_on_ray(config, job.inputs, job.done, engine_args_for(config, job.done.count(0)), write)


def check_input_unchanged(job: PreparedJob) -> None:
    """An input file rewritten while the job ran may have given it rows of both versions: the committed rows stay
    (the next run refuses them, naming the file), but no _SUCCESS is written over them."""
    changes = describe_changes({"files": job.fingerprint["files"]}, {"files": input_files(job.inputs)})
    if changes:
        raise JobConfigError(f"input.path: {changes} while the job ran; its output may mix rows of both versions: "
                             f"re-run with --overwrite to start over")


def _commit_quietly(writer: PartWriter) -> None:
    try:
        writer.commit()
    except Exception:
        pass  # the original failure is the one to report


def engine_args_for(config: JobConfig, rows_left: int) -> EngineArgs:
    """The job's engine settings for a run of `rows_left` rows: max_num_seqs no higher than the sequences they can
    run at once (a row of n samples, or of k choices, runs as n or k), so the engine sizes its KV pool for them
    (kv_pool.py) and not for the setting."""
    sampling = config.sampling
    per_row = max(sampling.n, len(sampling.choice), 1)
    return dataclasses.replace(config.engine, max_num_seqs=max(1, min(config.engine.max_num_seqs, rows_left * per_row)))


def load_engine(job: PreparedJob):
    from batchgen.engine import Engine
    from batchgen.models import ModelError

    rows_left = job.done.count(0) if job.done is not None else job.config.engine.max_num_seqs
    try:
        engine = Engine(engine_args_for(job.config, rows_left))
    except ModelError as exc:  # e.g. an architecture we do not support: a problem with the job, not a crash
        raise JobConfigError(f"model: {exc}") from None
    except SettingError as exc:  # a setting the engine cannot honour, e.g. a KV cache too small for the model
        raise setting_error(exc, "engine") from None
    check_chat_template(job.config, engine.tokenizer)
    return engine


def stream_rows(rows: Iterable[SourceRow], generate: Callable[[Iterator[Request]], Iterable[Result]],
                writer: PartWriter, on_row: Callable[[list[Result]], Any] = lambda results: None,
                json_schema: str | None = None) -> None:
    """Feed rows to `generate` lazily and write every row's results. Error rows skip the engine: their error result is
    written as they are pulled. A request of n samples gives n results (sample_index 0..n-1, the engine returns them
    together), or one error result: they are written as one group, so that no part holds only some of a row's
    samples. Only the requests inside the engine are remembered. `json_schema`: the job's, with output.parse_json
    (rows under another constraint are not parsed)."""
    in_engine: dict[int, tuple[Any, tuple, SamplingParams]] = {}  # row -> (id, kept values, sampling)

    def requests() -> Iterator[Request]:
        for row in rows:
            if row.error is not None:
                result = error_result(row)
                writer.add(row.row, row.id, row.keep, result)
                on_row([result])
                continue
            in_engine[row.row] = (row.id, row.keep, row.sampling)
            yield Request(row.row, row.token_ids, row.sampling)

    for group in result_groups(generate(requests()), lambda row: in_engine[row][2].n):
        ident, keep, sampling = in_engine.pop(group[0].request_id)
        writer.add(group[0].request_id, ident, keep, *group, parse_json=sampling.json_schema == json_schema)
        on_row(group)


def result_groups(results: Iterable[Result], samples: Callable[[Any], int]) -> Iterator[list[Result]]:
    """Each request's results together, in sample order, once all `samples(request_id)` of them arrived (or its one
    error result): the engine returns a request's samples in one step, but a caller must not rely on how its
    results are cut into steps."""
    arrived: dict[Any, list[Result]] = {}
    for result in results:
        group = arrived.setdefault(result.request_id, [])
        group.append(result)
        if len(group) < samples(result.request_id) and result.finish_reason != "error":
            continue
        del arrived[result.request_id]
        yield sorted(group, key=lambda sample: sample.sample_index)
    if arrived:
        request_id, group = next(iter(arrived.items()))
        raise RuntimeError(f"internal error: the engine returned {len(group)} of the {samples(request_id)} samples "
                           f"of row {request_id}")


def error_result(row: SourceRow) -> Result:
    return Result.for_error(row.row, row.error, row.prompt_tokens, time.time())


# What a run may hold beyond its weights and the KV blocks it used: python, torch and the other modules, the tokenizer,
# the sort window, a step's activations. Peak RSS above weights + used KV + this is worth a look.
MEMORY_OVERHEAD_BOUND = 2**30


def memory_bound(engine_stats: dict) -> int | None:
    """weights + the KV blocks ever used (the resident part of the pool) + MEMORY_OVERHEAD_BOUND; None when the
    engine did not run in this process."""
    if "weights_bytes" not in engine_stats:
        return None
    return engine_stats["weights_bytes"] + engine_stats["kv_bytes_touched"] + MEMORY_OVERHEAD_BOUND


def build_summary(job: PreparedJob, totals: RowTotals, progress: Progress, engine_stats: dict,
                  started_at: datetime, replicas: dict | None = None) -> dict:
    import torch

    wall_s = progress.elapsed_s
    peak = max(engine_stats.get("peak_memory_bytes", 0), peak_rss_bytes())
    dtype = resolved_dtype(job.config)
    summary = {
        "rows": totals.rows,
        "output_rows": totals.output_rows,
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
        "cost_per_hour": job.cost_per_hour,
        "tokens_per_dollar": progress.output_tokens / (wall_s / 3600 * job.cost_per_hour)
        if job.cost_per_hour and wall_s > 0 else None,
        "rows_this_run": progress.rows_this_run,
        "resumed": progress.rows_this_run < totals.rows,
        "peak_memory_bytes": peak,
        "memory_bound_bytes": memory_bound(engine_stats),
        "dtype": engine_stats.get("dtype", dtype.name),
        "dtype_reason": engine_stats.get("dtype_reason", dtype.reason),
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
    if replicas is not None:  # a Ray run: what each replica did (its rows, tokens, wall time and engine)
        summary["replicas"] = replicas
    return summary
