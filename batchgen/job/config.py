"""job.yaml -> a frozen, validated JobConfig. Every error names the key (or file) it is about.

The `engine:` keys are EngineArgs' fields (but model, dtype and device, which are top-level keys) and the
`sampling:` keys are SamplingParams' fields (and json_schema_file, read into json_schema when the job loads): a
field added there is a job key with no edit here. A value is checked once for its YAML type here, then by
EngineArgs.validate() or SamplingParams.validate(), whose SettingError names the field."""
from __future__ import annotations

import dataclasses
import json
import logging
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from batchgen.engine.engine_args import EngineArgs
from batchgen.engine.errors import SettingError
from batchgen.engine.request import CONSTRAINT_KEYS, SamplingParams
from batchgen.engine.structured import check_constraint

from batchgen.object_store import StorageConfig
from batchgen.redaction import redact
from batchgen.user_files import SCHEMA_FILE_LIMIT, UserFileError, read_user_text

from .job_file import read_job_file
from .keys import JobConfigError, check_bounded, keys_of, plain, read_keys
from .executor_config import ExecutorConfig
from .section_checks import check_executor, check_storage
from .output.column_names import OUTPUT_COLUMNS, ROW_COLUMN
from .prompt_template import template_columns
from .task_config import GENERATE, TASK_SECTIONS, check_task_sections, task_keys

log = logging.getLogger(__name__)

# Input columns with these names override the job's sampling value for their row. A row's constraint (one of
# CONSTRAINT_KEYS) replaces the job's, whichever key the job used.
ROW_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "logprobs", "stop",
                     "presence_penalty", "frequency_penalty") + CONSTRAINT_KEYS

# EngineArgs fields that the job file has as top-level keys rather than under `engine:`. `lora` maps adapter names
# to where each is (a local directory, a hub id or an s3:// prefix): the run gives the engine local directories.
TOP_LEVEL_KEYS = ("model", "task", "dtype", "device", "lora")

# The job's sampling defaults where they differ from SamplingParams' (vLLM's 16 tokens at temperature 1.0):
# a batch job wants reproducible, greedy output of a useful length.
JOB_SAMPLING_DEFAULTS = {"max_tokens": 256, "temperature": 0.0}

SortOrder = Literal["prefix", "length", "none"]


@dataclass(frozen=True)
class InputConfig:
    path: str
    format: Literal["auto", "parquet", "jsonl", "csv", "openai-batch"] = "auto"  # auto: from each file's name
    id_column: str | None = None
    prompt_column: str = "prompt"
    messages_column: str | None = None
    system_prompt: str | None = None
    system_column: str | None = None
    lora_column: str | None = "lora"  # each row's LoRA adapter, a name of `lora:` (null: lora_default); read if there
    template: str | None = None
    chat_template: bool | str = True  # true: the model's; a string: this Jinja template; false: none
    allow_special_tokens: bool = False  # true: special-token text in the data becomes special tokens
    sort: SortOrder = "prefix"
    sort_window: int = 10_000
    read_batch_rows: int = 1024


def _params(self, **overrides: Any) -> SamplingParams:
    """The job's sampling values as SamplingParams, with a row's `overrides`."""
    values = {**dataclasses.asdict(self), **overrides}
    return SamplingParams(**{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()})


def _sampling_config() -> type:
    """SamplingParams' fields as a frozen dataclass (lists become tuples), with JOB_SAMPLING_DEFAULTS."""
    hints = typing.get_type_hints(SamplingParams)
    fields = []
    for f in dataclasses.fields(SamplingParams):
        hint = hints[f.name]
        default = JOB_SAMPLING_DEFAULTS.get(f.name, f.default_factory() if f.default is dataclasses.MISSING
                                            else f.default)
        if typing.get_origin(hint) is list:
            hint, default = tuple[typing.get_args(hint)[0], ...], tuple(default)
        fields.append((f.name, hint, dataclasses.field(default=default)))
    namespace = {"params": _params, "__module__": __name__}
    return dataclasses.make_dataclass("SamplingConfig", fields, frozen=True, namespace=namespace)


SamplingConfig = _sampling_config()


def _integer_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    hints = typing.get_type_hints(SamplingParams)
    return tuple(key for key in keys if int in (hints[key], *typing.get_args(hints[key])))


# The per-row keys that SamplingParams holds as integers: a float column's whole values (5.0) become ints.
ROW_INTEGER_KEYS = _integer_keys(ROW_SAMPLING_KEYS)

# The job's sampling keys: SamplingConfig's, and json_schema_file, read when the job loads into json_schema.
SAMPLING_KEYS = {**keys_of(SamplingConfig), "json_schema_file": (str | None, False)}


@dataclass(frozen=True)
class OutputConfig:
    path: str
    keep_columns: tuple[str, ...] = ()
    order: Literal["input", "completion"] = "input"
    rows_per_part: int = 1000
    commit_interval_s: float = 60.0
    parse_json: bool = False  # the `json` column: each row's text parsed, typed from sampling.json_schema
    report: bool = True  # _report.html, the job report, written before _SUCCESS
    format: Literal["parquet", "jsonl", "openai-batch"] = "parquet"  # the final files (output/final_formats.py)


@dataclass(frozen=True)
class JobConfig:
    input: InputConfig
    output: OutputConfig
    sampling: SamplingConfig
    engine: EngineArgs  # validated; holds the job's top-level model, task, dtype and device too (do not mutate)
    executor: ExecutorConfig = ExecutorConfig()
    storage: StorageConfig = StorageConfig()
    lora_default: str | None = None  # the adapter of a row that names none (None: the base model)
    # the prefill-only tasks' sections (task_config.py); the job's task reads its own
    embed: TASK_SECTIONS["embed"] = TASK_SECTIONS["embed"]()
    classify: TASK_SECTIONS["classify"] = TASK_SECTIONS["classify"]()
    score: TASK_SECTIONS["score"] = TASK_SECTIONS["score"]()

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def task(self) -> str:
        return self.engine.task

    @property
    def task_section(self):
        """The section of the job's task (embed, classify or score); None for generate."""
        return None if self.task == GENERATE else getattr(self, self.task)

    @property
    def dtype(self) -> str:
        return self.engine.dtype

    @property
    def device(self) -> str:
        return self.engine.device

    def to_dict(self) -> dict[str, Any]:
        """The job file's keys with plain JSON-able values (tuples become lists), as _SUCCESS and the report show
        them: the keys that may hold a URL (and so a credential: http://user:password@host) redacted. A generate
        job has `sampling`, another task its own section instead."""
        engine = dataclasses.asdict(self.engine)
        top = {key: engine.pop(key) for key in TOP_LEVEL_KEYS}
        if not top["lora"]:
            del top["lora"]
        else:
            top["lora"] = {name: redact(ref) for name, ref in top["lora"].items()}
            top["lora_default"] = self.lora_default
        task = {"sampling": dataclasses.asdict(self.sampling)} if self.task_section is None else \
            {self.task: dataclasses.asdict(self.task_section)}
        found = plain({"input": dataclasses.asdict(self.input), "output": dataclasses.asdict(self.output), **top,
                       **task, "engine": engine,
                       "executor": dataclasses.asdict(self.executor), "storage": dataclasses.asdict(self.storage)})
        for keys, key in ((found["input"], "path"), (found["output"], "path"), (found["storage"], "endpoint_url"),
                          (found["executor"], "address"), (found, "model")):
            if isinstance(keys[key], str):
                keys[key] = redact(keys[key])
        return found


# engine.sort is the deprecated spelling of input.sort.
ENGINE_KEYS = {**keys_of(EngineArgs, skip=TOP_LEVEL_KEYS), "sort": (SortOrder | None, False)}

# The job file's keys. A dataclass is a section built as that class, a dict a section read as a dict.
JOB_KEYS = {
    "input": (InputConfig, True),
    "output": (OutputConfig, True),
    "model": (str, False),
    **task_keys(),  # task, and the embed, classify and score sections
    "dtype": (Literal["auto", "float32", "bfloat16", "float16"], False),
    "device": (Literal["auto", "cpu", "cuda"], False),
    "lora": keys_of(EngineArgs)["lora"],
    "lora_default": (str | None, False),
    "sampling": (SAMPLING_KEYS, False),
    "engine": (ENGINE_KEYS, False),
    "executor": (ExecutorConfig, False),
    "storage": (StorageConfig, False),
}


def load_job(path: str | Path, overrides: typing.Sequence[str] = ()) -> JobConfig:
    """Read a job file (job_file.py), apply `--set key.path=value` overrides and validate. Files the job names
    (sampling.json_schema_file) are found relative to the job file's directory."""
    path = Path(path)
    return parse_job(read_job_file(path, overrides), base_dir=path.parent)


def parse_job(raw: dict[str, Any], base_dir: Path | None = None) -> JobConfig:
    """The job from its raw mapping; `base_dir` is where relative paths of files the job names are found (default:
    the current directory)."""
    check_bounded(raw)
    values = read_keys(JOB_KEYS, _with_schema_text(raw), prefix="")
    values["sampling"] = _sampling(values["sampling"], base_dir)
    engine = values.pop("engine")
    explicit_sort = "sort" in (raw.get("input") or {})
    source = _input_with_sort(values.pop("input"), engine.pop("sort", None), explicit_sort)
    task = values.get("task", GENERATE)
    check_task_sections(task, raw, values)
    if task != GENERATE and "chat_template" not in (raw.get("input") or {}):  # a text to embed, classify or score
        source = dataclasses.replace(source, chat_template=False)             # is the text itself by default
    if task in ("embed", "classify") and not explicit_sort and "sort" not in (raw.get("engine") or {}):
        source = dataclasses.replace(source, sort="length")  # rows of like length batch together: less padding
    engine_args = EngineArgs(**{key: values.pop(key) for key in TOP_LEVEL_KEYS if key in values}, **engine)
    if source.format == "openai-batch":  # each request's own id, and its endpoint kept for its response's form
        source = dataclasses.replace(source, id_column=source.id_column or "custom_id")
        output = values["output"]
        if "url" not in output.keep_columns:
            values["output"] = dataclasses.replace(output, keep_columns=(*output.keep_columns, "url"))
    if source.lora_column not in (None, InputConfig.lora_column) and not engine_args.lora:
        raise JobConfigError("input.lora_column: the job has no adapters to choose from (add a lora: map of adapter "
                             "names to adapters)")
    config = JobConfig(input=source, engine=engine_args, **values)
    _check(config)
    return config


def _input_with_sort(source: InputConfig, engine_sort: str | None, explicit: bool) -> InputConfig:
    """Honour the deprecated engine.sort; a conflicting input.sort is an error."""
    if engine_sort is None:
        return source
    if explicit and engine_sort != source.sort:
        raise JobConfigError(f"engine.sort: {engine_sort!r} conflicts with input.sort: {source.sort!r}; "
                             f"engine.sort is deprecated, keep only input.sort")
    log.warning("engine.sort is deprecated: write input.sort: %s instead", engine_sort)
    return dataclasses.replace(source, sort=engine_sort)


# -- sampling.json_schema: inline (a mapping or JSON text) or from a file -----------------------------------------

def _with_schema_text(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with an inline sampling.json_schema mapping written as JSON text (its key order kept: the order of
    properties is the order they are generated in). A string is taken as JSON text already."""
    sampling = raw.get("sampling")
    if not isinstance(sampling, dict) or not isinstance(sampling.get("json_schema"), (dict, list)):
        return raw
    try:
        text = json.dumps(sampling["json_schema"], ensure_ascii=False)
    except (TypeError, ValueError) as exc:  # e.g. an unquoted YAML date
        raise JobConfigError(f"sampling.json_schema: cannot be written as JSON: {exc} (quote the value)") from None
    return {**raw, "sampling": {**sampling, "json_schema": text}}


def _sampling(values: dict[str, Any], base_dir: Path | None) -> SamplingConfig:
    """The sampling section, sampling.json_schema_file read into json_schema and checked there (its errors name
    the file key)."""
    file = values.pop("json_schema_file", None)
    if file is None:
        return SamplingConfig(**values)
    key = "sampling.json_schema_file"
    if values.get("json_schema") is not None:
        raise JobConfigError(f"{key}: set sampling.json_schema or sampling.json_schema_file, not both")
    path = Path(file).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        text = read_user_text(path, SCHEMA_FILE_LIMIT)
    except UserFileError as exc:
        raise JobConfigError(f"{key}: {exc}") from None
    try:
        check_constraint("json_schema", text, quote_values=False)  # a file's contents are not echoed: it may be
    except SettingError as exc:                                     # a credentials file given by mistake
        raise JobConfigError(f"{key}: {path}: {exc}") from None
    return SamplingConfig(**values, json_schema=text)


# -- checks across keys ------------------------------------------------------------------------------------------

def _check(config: JobConfig) -> None:
    if not config.model.strip():
        raise JobConfigError("model: must not be empty")
    _check_input(config.input, config.task)
    _validate(config.engine, "engine")
    _validate(config.sampling.params(), "sampling")
    _check_output(config.output)
    _check_lora(config)
    check_executor(config.executor)
    check_storage(config.storage)
    if config.output.parse_json and config.sampling.json_schema is None:
        raise JobConfigError("output.parse_json: needs sampling.json_schema (or sampling.json_schema_file): the "
                             "json column is typed from it")


def _check_lora(config: JobConfig) -> None:
    adapters = config.engine.lora or {}
    if adapters and config.task != GENERATE:
        raise JobConfigError(f"lora: adapters apply to task generate, not {config.task}")
    if config.lora_default is not None and config.lora_default not in adapters:
        known = f"its adapters: {', '.join(adapters)}" if adapters else "the job has no lora: map"
        raise JobConfigError(f"lora_default: {config.lora_default!r} is not an adapter of lora: ({known})")


def _validate(settings: EngineArgs | SamplingParams, section: str) -> None:
    try:
        settings.validate()
    except SettingError as exc:
        raise setting_error(exc, section) from None


def setting_error(exc: SettingError, section: str) -> JobConfigError:
    """An invalid EngineArgs or SamplingParams field as a job error naming its job key: model, dtype, device,
    or `section`.<field>."""
    key = exc.key if exc.key in TOP_LEVEL_KEYS else f"{section}.{exc.key}"
    message = str(exc)
    return JobConfigError(message if message.startswith(f"{key}:") else f"{key}: {message}")


def _check_input(cfg: InputConfig, task: str = GENERATE) -> None:
    if not cfg.path.strip():
        raise JobConfigError("input.path: must not be empty")
    for name in ("id_column", "prompt_column", "messages_column", "system_column", "lora_column"):
        value = getattr(cfg, name)
        if value is not None and not value.strip():
            raise JobConfigError(f"input.{name}: must be a column name, got an empty string")
    if cfg.messages_column and cfg.template is not None:
        raise JobConfigError("input.template: cannot be combined with input.messages_column")
    if cfg.system_prompt is not None and cfg.system_column:
        raise JobConfigError("input.system_column: set input.system_prompt or input.system_column, not both")
    if isinstance(cfg.chat_template, str):
        _check_chat_template(cfg.chat_template)
    if not cfg.chat_template:
        for name in ("messages_column", "system_prompt", "system_column"):
            if getattr(cfg, name) is not None:
                raise JobConfigError(f"input.{name}: needs input.chat_template: true")
    if cfg.template is not None:
        template_columns(cfg.template)  # raises on a malformed template
    if cfg.format == "openai-batch" and (cfg.messages_column or cfg.template is not None
                                        or (not cfg.chat_template and task == GENERATE) or cfg.prompt_column != "prompt" or cfg.id_column != "custom_id"):
        raise JobConfigError("input.format: openai-batch reads each request's own prompt and custom_id; leave out "
                             "input.messages_column, template, prompt_column, id_column and chat_template: false")
    if cfg.sort_window < 1:
        raise JobConfigError("input.sort_window: must be at least 1")
    if cfg.read_batch_rows < 1:
        raise JobConfigError("input.read_batch_rows: must be at least 1")


def _check_chat_template(text: str) -> None:
    """A job's own chat template: Jinja that renders `messages` (a plain word such as `yes` is a typo for true)."""
    if "{{" not in text and "{%" not in text:
        raise JobConfigError(f"input.chat_template: expected true or false, or a Jinja chat template (with "
                             f"{{{{ ... }}}} or {{% ... %}}), got {text!r}")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise JobConfigError(f"input.chat_template: not a valid Jinja template: {exc.message} (line {exc.lineno})") \
            from None


def _check_output(cfg: OutputConfig) -> None:
    if not cfg.path.strip():
        raise JobConfigError("output.path: must not be empty")
    for i, column in enumerate(cfg.keep_columns):
        if column in OUTPUT_COLUMNS or column == ROW_COLUMN:
            raise JobConfigError(f"output.keep_columns: {column!r} clashes with an output column")
        if column in cfg.keep_columns[:i]:
            raise JobConfigError(f"output.keep_columns: {column!r} is listed twice")
    if cfg.rows_per_part < 1:
        raise JobConfigError("output.rows_per_part: must be at least 1")
    if cfg.commit_interval_s <= 0:
        raise JobConfigError("output.commit_interval_s: must be positive")
