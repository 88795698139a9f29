"""What `batchgen plan` and both executors share, before any model loads: every check that needs no model
(job-level problems raise JobConfigError), the job's fingerprint (what decides its rows' results), the output's lock
and the engine settings a run gets."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchgen.engine.engine_args import EngineArgs
from batchgen.engine.kv_pool import kv_cache_budget
from batchgen.machine import available_memory
from batchgen.object_store import RemoteFile, StorageConfig, is_remote, obstore_missing

from .config import JobConfig, JobConfigError
from .missing_bucket import bucket_must_exist
from .input.files import InputFiles, inspect_input
from .output.json_output import schema_json_type
from .output.open_output import open_output
from .output.parts import run_part_schema
from .output.resume import check_output, describe_changes, input_identity, output_errors
from .output.schema import ROW_POSITION_ID_TYPE, OutputOptions, output_schema
from .output.store import OutputStore

if TYPE_CHECKING:  # the job layer imports torch only where it needs it
    from batchgen.engine.engine_plan import EngineTarget
    from batchgen.lora.sources import LocatedAdapter

# The parts of a job that change its results: a resume is refused when any of them differs.
PROMPT_KEYS = ("id_column", "prompt_column", "messages_column", "system_prompt", "system_column", "template",
               "chat_template", "allow_special_tokens")


@dataclass
class PreparedJob:
    config: JobConfig
    inputs: InputFiles
    fingerprint: dict[str, Any]
    out: OutputStore  # a local directory or an object-store prefix; a run holds its lock (flock or lease)
    complete: dict | None = None  # the _SUCCESS summary when the job already finished
    done: bytearray | None = None  # the ledger read when the output was taken: done[row] for committed rows
    cost_per_hour: float | None = None  # the machine's price, for _SUCCESS's tokens_per_dollar
    target: EngineTarget | None = None  # the run's device and dtype and why, resolved once (engine_target)
    adapters: dict[str, LocatedAdapter] = dataclasses.field(default_factory=dict)  # the job's lora:, found locally
    calibration: dict | None = None  # quantization_calibration's record, once measured or read (job/calibration.py)
    calibration_source: str | None = None  # "measured" or "read" (the output's _calibration.json)

    @property
    def model(self) -> str:
        """The model the run loads: the fingerprint's, so a hub id is loaded at the commit the fingerprint pins even
        if its branch moves meanwhile (the job's own `model` where a fingerprint was made without one)."""
        return self.fingerprint.get("model") or self.config.model

    @property
    def options(self) -> OutputOptions:
        return output_options(self.config, self.inputs.column_types)

    @property
    def schema(self) -> pa.Schema:
        types = self.inputs.column_types
        id_type = types[self.config.input.id_column] if self.config.input.id_column else ROW_POSITION_ID_TYPE
        return output_schema(id_type, [(c, types[c]) for c in self.config.output.keep_columns], self.options)

    @property
    def run_schema(self) -> pa.Schema:
        return run_part_schema(self.schema, fingerprint_text(self.fingerprint))

    def release(self) -> None:
        self.out.unlock()


def output_options(config: JobConfig, input_columns: Container[str]) -> OutputOptions:
    """What decides the job's conditional output columns (schema.py): its sampling and output keys, and which
    per-row sampling columns its input has."""
    if config.task_section is not None:  # a prefill-only task: its own columns, none of generation's
        return OutputOptions(task=config.task, token_logprobs=getattr(config.task_section, "token_logprobs", False),
                             replica=config.executor.kind == "ray")
    sampling = config.sampling
    return OutputOptions(samples=sampling.n > 1 or "n" in input_columns,
                         choice=bool(sampling.choice) or "choice" in input_columns,
                         logprobs=sampling.logprobs is not None or "logprobs" in input_columns,
                         json=schema_json_type(sampling.json_schema) if config.output.parse_json else None,
                         replica=config.executor.kind == "ray", lora=bool(config.engine.lora))


def prepare_job(config: JobConfig, overwrite: bool = False) -> PreparedJob:
    """Every check that needs no model: inspect_job's, and what the output directory holds. Takes the output's lock
    unless the job is already complete."""
    job = inspect_job(config)
    with output_errors(job.out):
        job.complete = check_output(job.out, job.fingerprint, overwrite, job.run_schema)
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
    adapters = locate_adapters(config, no_download_because)
    target = engine_target(config)
    check_kv_cache_memory(config.engine, target.device.type)
    return PreparedJob(config, inputs, job_fingerprint(config, model, inputs, target, adapters),
                       open_output(config.output.path, config.storage), target=target, adapters=adapters)


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
    from batchgen.models.encoder_support import is_encoder_model
    from batchgen.models.loader import (ModelError, check_model_files, find_model, has_chat_template, locate_model,
                                        model_id)

    try:
        if is_remote(ref):
            missing = obstore_missing("model", ref)
            if missing:
                raise JobConfigError(missing)
            from batchgen.models.object_model import fetch_model
            with bucket_must_exist("model", ref):
                ref = str(fetch_model(ref, storage))  # downloaded once into the cache, then the directory it is
        path = find_model(ref, no_download_because)
        if path.is_dir() and is_encoder_model(path):  # the encoder engine's (BERT family): its files are checked;
            check_model_files(path)                    # locate_model's architecture check is a decoder's
        else:
            path = locate_model(ref, no_download_because)
        templated = has_chat_template(path) if chat_template else False
        identity = model_id(ref, path)
    except ModelError as exc:
        raise JobConfigError(f"model: {exc}") from None
    if chat_template and not templated:
        raise no_chat_template(ref)
    return identity


def locate_adapters(config: JobConfig, no_download_because: str | None = None) -> dict[str, LocatedAdapter]:
    """Each adapter of the job's `lora:` map as a local directory (fetched from the hub or object storage once),
    its files there; what they hold is checked against the model before its weights load (engine start-up)."""
    if not config.engine.lora:
        return {}
    from batchgen.lora.sources import locate_adapter
    from batchgen.models.registry import ModelError

    found = {}
    for name, ref in (config.engine.lora or {}).items():
        try:
            if is_remote(ref):
                missing = obstore_missing(f"lora.{name}", ref)
                if missing:
                    raise JobConfigError(missing)
                with bucket_must_exist(f"lora.{name}", ref):
                    found[name] = locate_adapter(ref, config.storage, no_download_because)
            else:
                found[name] = locate_adapter(ref, config.storage, no_download_because)
        except ModelError as exc:
            raise JobConfigError(f"lora.{name}: {exc}") from None
    return found


def engine_target(config: JobConfig) -> EngineTarget:
    """The run's device and its dtype and why, by the engine's own rule (engine_plan.resolve_target), which needs no
    model: what the fingerprint records and the summary falls back on. A device: cuda without one is a job error."""
    from batchgen.engine.engine_plan import resolve_target
    from batchgen.engine.errors import SettingError

    try:
        return resolve_target(config.device, config.dtype)
    except SettingError as exc:  # the one it raises: device cuda, and torch sees none
        raise JobConfigError(f"{exc} (use auto or cpu)") from None


def check_kv_cache_memory(engine: EngineArgs, device: str) -> None:
    """A KV cache larger than the memory available would fail in the allocator, after the model loaded: refuse it
    now. On CUDA only a size that was set is checked (the default is sized from the device once the model loads)."""
    budget = kv_cache_budget(engine, device)
    if budget is None:
        return
    size, limit = budget[0], available_memory(device)
    if size > limit[0]:
        shown = "the default, " if engine.kv_cache_memory is None else ""
        raise JobConfigError(f"engine.kv_cache_memory: {engine.cpu_kv_cache_memory()!r} ({shown}{size / 2**30:,.1f} "
                             f"GiB) is more than the memory available ({limit[0] / 2**30:,.1f} GiB, {limit[1]}); "
                             f"set a smaller size")


def job_fingerprint(config: JobConfig, model: str, inputs: InputFiles, target: EngineTarget | None = None,
                    adapters: dict[str, LocatedAdapter] | None = None) -> dict[str, Any]:
    """What decides the rows' results (engine settings other than quantization, and sorting, do not), the identity
    of each input file included: a rewritten input is another job. The dtype is the one `auto` resolves to here:
    resuming on a machine where it resolves to another would mix rows of both."""
    return {
        "model": model,
        # a GGUF's weights are what its conversion makes of them (fp32 before, int8 since format 2)
        **({"gguf_conversion": conversion} if (conversion := gguf_conversion(model)) else {}),
        "dtype": (target or engine_target(config)).dtype.name,
        "input": {key: getattr(config.input, key) for key in PROMPT_KEYS},
        "files": input_files(inputs),
        # what a row's result is made by: generate's sampling, or another task and its section (absent for generate,
        # so that outputs written before `task` existed still resume)
        **({"sampling": config.to_dict()["sampling"]} if config.task_section is None else
           {"task": config.task, config.task: config.to_dict()[config.task]}),
        "keep_columns": list(config.output.keep_columns),
        # int8 weights change the results; absent when off, so outputs written before the setting still resume
        **({"quantization": config.engine.quantization} if config.engine.quantization else {}),
        # which layers a calibrated int8 keeps in the dtype; absent when unset, for the same reason
        **({name: dataclasses.asdict(config.engine)[name] for name in ("quantization_calibration", "quantization_keep")
            if getattr(config.engine, name, None) is not None}),
        # static scales or smoothing factors set by hand (the calibration's are under its own key): their digest
        **({"quantization_scales": hashlib.sha256(json.dumps(config.engine.quantization_scales, sort_keys=True)
                                                  .encode()).hexdigest()[:16]}
           if getattr(config.engine, "quantization_scales", None) else {}),
        # an int8 KV cache rounds K and V (outputs change); speculation does not change them, so it is not here.
        # Its keys are stored turned by a Hadamard matrix since (models/attention.py): earlier int8 outputs differ
        **({"kv_cache_dtype": config.engine.kv_cache_dtype, "kv_int8_keys": "hadamard"}
           if config.engine.kv_cache_dtype != "auto" else {}),
        # a shorter context cuts rows short (finish_reason length); absent when unset, for the same reason
        **({"max_model_len": config.engine.max_model_len} if config.engine.max_model_len else {}),
        # batch-invariant arithmetic gives some rows other bits than the default's; absent when off, as above
        **({"batch_invariant": True} if config.engine.batch_invariant else {}),
        # LoRA adapters: each one's pinned source and file digest, and which rows take which; absent without
        **({"lora": {name: found.identity() for name, found in adapters.items()},
            "lora_default": config.lora_default, "lora_column": config.input.lora_column} if adapters else {}),
    }


def gguf_conversion(model: str) -> int | None:
    """The conversion format of the GGUF that the model identity `model` (check_model's) names, None for a model
    directory."""
    from batchgen.models.gguf_cache import CONVERSION_FORMAT
    from batchgen.models.named import NAMED_MODELS

    return CONVERSION_FORMAT if model in NAMED_MODELS or Path(model).is_file() else None


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
    job.out.lock()
    try:
        job.complete = check_output(job.out, job.fingerprint, overwrite, job.run_schema)
        if job.complete is not None:  # finished by the run that held the lock (or lease)
            job.out.discard_scratch()
            job.release()
            return
        if overwrite:
            job.out.remove_outputs()
        if job.out.pending_rewrite() is None:
            job.done = job.out.done_rows(job.inputs.total_rows)
    except BaseException:
        job.release()
        raise


def check_input_unchanged(job: PreparedJob) -> None:
    """An input file rewritten while the job ran may have given it rows of both versions: the committed rows stay
    (the next run refuses them, naming the file), but no _SUCCESS is written over them."""
    changes = describe_changes({"files": job.fingerprint["files"]}, {"files": input_files(job.inputs)})
    if changes:
        raise JobConfigError(f"input.path: {changes} while the job ran; its output may mix rows of both versions: "
                             f"re-run with --overwrite to start over")


def engine_args_for(config: JobConfig, rows_left: int, model: str | None = None,
                    adapters: dict[str, LocatedAdapter] | None = None) -> EngineArgs:
    """The job's engine settings for a run of `rows_left` rows: max_num_seqs no higher than the sequences they can
    run at once (a row of n samples, or of k choices, runs as n or k), so the engine sizes its KV pool for them
    (kv_pool.py) and not for the setting; `model`, when given (PreparedJob.model), instead of the job's, and the
    adapters' local directories (PreparedJob.adapters) instead of the job's references."""
    sampling = config.sampling
    per_row = max(sampling.n, len(sampling.choice), 1)
    lora = {name: str(found.path) for name, found in adapters.items()} if adapters else config.engine.lora
    return dataclasses.replace(config.engine, model=model or config.engine.model, lora=lora,
                               max_num_seqs=max(1, min(config.engine.max_num_seqs, rows_left * per_row)))
