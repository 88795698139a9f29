"""What `batchgen plan` and both executors share, before any model loads: every check that needs no model
(job-level problems raise JobConfigError), the job's fingerprint (what decides its rows' results), the output's lock
and the engine settings a run gets."""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.engine.engine_args import EngineArgs
from batchgen.engine.kv_pool import kv_cache_budget
from batchgen.machine import available_memory
from batchgen.object_store import RemoteFile, StorageConfig, is_remote, obstore_missing

from .config import JobConfig, JobConfigError
from .keys import OutputBusy
from .missing_bucket import bucket_must_exist
from .input.files import InputFiles, inspect_input
from .output.object_output import ObjectOutput, check_output_at, open_output
from .output.resume import describe_changes, input_identity, output_errors
from .output.schema import ROW_POSITION_ID_TYPE, OutputOptions, output_schema
from .output.sink import OutputDir, run_part_schema

# The parts of a job that change its results: a resume is refused when any of them differs.
PROMPT_KEYS = ("id_column", "prompt_column", "messages_column", "system_prompt", "system_column", "template",
               "chat_template", "allow_special_tokens")


@dataclass
class PreparedJob:
    config: JobConfig
    inputs: InputFiles
    fingerprint: dict[str, Any]
    out: OutputDir | ObjectOutput
    complete: dict | None = None  # the _SUCCESS summary when the job already finished
    lock_fd: int | None = None  # a local output's lock (an object-store output holds a lease instead)
    done: bytearray | None = None  # the ledger read when the output was taken: done[row] for committed rows
    cost_per_hour: float | None = None  # the machine's price, for _SUCCESS's tokens_per_dollar

    @property
    def model(self) -> str:
        """The model the run loads: the fingerprint's, so a hub id is loaded at the commit the fingerprint pins even
        if its branch moves meanwhile (the job's own `model` where a fingerprint was made without one)."""
        return self.fingerprint.get("model") or self.config.model

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
        if isinstance(self.out, ObjectOutput):
            self.out.release_lease()


def prepare_job(config: JobConfig, overwrite: bool = False) -> PreparedJob:
    """Every check that needs no model: inspect_job's, and what the output directory holds. Takes the output's lock
    unless the job is already complete."""
    job = inspect_job(config)
    with output_errors(job.out):
        job.complete = check_output_at(job.out, job.fingerprint, overwrite, job.run_schema)
        if job.complete is None:
            take_output(job, overwrite)
    return job


def inspect_job(config: JobConfig, no_download_because: str | None = None) -> PreparedJob:
    """The read-only checks that need no model (`batchgen plan` runs them too): input files and columns, model
    location, device and memory (the engine settings were validated with the job). A hub model absent from the HF
    cache is downloaded, unless `no_download_because` says why not."""
    with bucket_must_exist("input.path", config.input.path):
        inputs = inspect_input(config)
    check_executor(config)
    model = check_model(config.model, no_download_because, chat_template=config.input.chat_template is True,
                        storage=config.storage)
    check_device(config.device)
    check_kv_cache_memory(config.engine)
    return PreparedJob(config, inputs, job_fingerprint(config, model, inputs),
                       open_output(config.output.path, config.storage))


def check_chat_template(config: JobConfig, tokenizer) -> None:
    if config.input.chat_template is True and getattr(tokenizer, "chat_template", None) is None:
        raise no_chat_template(config.model)


def no_chat_template(model: str) -> JobConfigError:
    return JobConfigError(f"input.chat_template: model {model} has no chat template; set input.chat_template: false "
                          f"(or give one: input.chat_template: <a Jinja template>)")


def check_executor(config: JobConfig) -> None:
    """executor.kind: ray needs Ray Data, an optional extra."""
    if config.executor.kind == "ray":
        try:
            import ray.data  # noqa: F401
        except ImportError:
            raise JobConfigError("executor.kind: ray needs Ray, which is not installed: pip install -e \".[ray]\" "
                                 "in batchgen's checkout (scripts/setup.sh installs it)") from None


def check_model(ref: str, no_download_because: str | None = None, chat_template: bool = False,
                storage: StorageConfig = StorageConfig()) -> str:
    """Where the model is, checked cheaply (no loading, no conversion), and that it has a chat template when the
    job uses the model's own (`chat_template`): what identifies it in the fingerprint (loader.model_id: a hub id
    pinned to its commit; a model in object storage: its cache entry, whose name pins its objects' ETags)."""
    from batchgen.models.loader import ModelError, has_chat_template, locate_model, model_id

    try:
        if is_remote(ref):
            missing = obstore_missing("model", ref)
            if missing:
                raise JobConfigError(missing)
            from batchgen.models.object_model import fetch_model
            with bucket_must_exist("model", ref):
                ref = str(fetch_model(ref, storage))  # downloaded once into the cache, then the directory it is
        path = locate_model(ref, no_download_because)
        templated = has_chat_template(path) if chat_template else False
        identity = model_id(ref, path)
    except ModelError as exc:
        raise JobConfigError(f"model: {exc}") from None
    if chat_template and not templated:
        raise no_chat_template(ref)
    return identity


def check_device(device: str) -> None:
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise JobConfigError("device: cuda was asked for but torch sees no CUDA device (use auto or cpu)")


def check_kv_cache_memory(engine: EngineArgs) -> None:
    """A KV cache larger than the memory available would fail in the allocator, after the model loaded: refuse it
    now. On CUDA only a size that was set is checked (the default is sized from the device once the model loads)."""
    from batchgen.engine.startup import resolve_device

    device = resolve_device(engine.device).type
    budget = kv_cache_budget(engine, device)
    if budget is None:
        return
    size, limit = budget[0], available_memory(device)
    if size > limit[0]:
        shown = "the default, " if engine.kv_cache_memory is None else ""
        raise JobConfigError(f"engine.kv_cache_memory: {engine.cpu_kv_cache_memory()!r} ({shown}{size / 2**30:,.1f} "
                             f"GiB) is more than the memory available ({limit[0] / 2**30:,.1f} GiB, {limit[1]}); "
                             f"set a smaller size")


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
        # batch-invariant arithmetic gives some rows other bits than the default's; absent when off, as above
        **({"batch_invariant": True} if config.engine.batch_invariant else {}),
    }


def resolved_dtype(config: JobConfig):
    """The run's dtype and why (a cpu_features.DtypeChoice): the engine's own rule, which needs no model."""
    from batchgen.engine.startup import resolve_device, resolve_dtype

    return resolve_dtype(config.dtype, resolve_device(config.device))


def input_files(inputs: InputFiles) -> list[dict[str, Any]]:
    """Each input file's path, rows and identity; a text input's (JSON lines, CSV, OpenAI Batch) are those of the
    file the job names, with its format."""
    text = {"format": inputs.format} if inputs.sources else {}
    return [{"path": str(path) if isinstance(path, RemoteFile) else str(path.resolve()), "rows": rows,
             **input_identity(path), **text}
            for path, rows in zip(inputs.sources or inputs.files, inputs.row_counts)]


def fingerprint_text(fingerprint: dict[str, Any]) -> str:
    return json.dumps(fingerprint, sort_keys=True)


def take_output(job: PreparedJob, overwrite: bool) -> None:
    """Lock the output, clear it (--overwrite) and read what earlier runs committed. The output is checked again
    once locked: a run that held the lock may have finished it (or committed more) since the first check. An
    object-store output's lock is its lease (output/lease.py)."""
    if isinstance(job.out, ObjectOutput):
        job.out.take_lease()
    else:
        job.lock_fd = lock_output(job.out)
    try:
        job.complete = check_output_at(job.out, job.fingerprint, overwrite, job.run_schema)
        if job.complete is not None:  # finished by the run that held the lock (or lease)
            if isinstance(job.out, OutputDir):
                shutil.rmtree(job.out.tmp, ignore_errors=True)  # while locked, so that no other run holds this lock
            job.release()
            return
        if overwrite:
            job.out.remove_outputs()
        if job.out.pending_rewrite() is None:
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


def lock_holder(out: OutputDir) -> int | None:
    """The pid holding a running batchgen's lock on this output, from /proc/locks (Linux) without touching the
    lock: taking it, even for an instant, could make a run that starts then fail."""
    lock = out.tmp / "lock"  # lock_output's file
    try:
        stat = lock.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    for line in table.splitlines():
        fields = line.split()
        if "FLOCK" in fields and device in fields:
            return int(fields[fields.index(device) - 1])
    return None


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
            holder = lock_holder(out)
            raise OutputBusy(f"output.path: another batchgen run is writing {out.path}"
                             f"{'' if holder is None else f' (pid {holder})'}; retry once it has finished") from None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed or replaced after we opened it: open the one there now
    raise JobConfigError(f"output.path: the lock file {path} keeps being replaced; is another batchgen run "
                         f"starting and finishing on {out.path}?")


def check_input_unchanged(job: PreparedJob) -> None:
    """An input file rewritten while the job ran may have given it rows of both versions: the committed rows stay
    (the next run refuses them, naming the file), but no _SUCCESS is written over them."""
    changes = describe_changes({"files": job.fingerprint["files"]}, {"files": input_files(job.inputs)})
    if changes:
        raise JobConfigError(f"input.path: {changes} while the job ran; its output may mix rows of both versions: "
                             f"re-run with --overwrite to start over")


def engine_args_for(config: JobConfig, rows_left: int, model: str | None = None) -> EngineArgs:
    """The job's engine settings for a run of `rows_left` rows: max_num_seqs no higher than the sequences they can
    run at once (a row of n samples, or of k choices, runs as n or k), so the engine sizes its KV pool for them
    (kv_pool.py) and not for the setting; `model`, when given (PreparedJob.model), instead of the job's."""
    sampling = config.sampling
    per_row = max(sampling.n, len(sampling.choice), 1)
    return dataclasses.replace(config.engine, model=model or config.engine.model,
                               max_num_seqs=max(1, min(config.engine.max_num_seqs, rows_left * per_row)))
