"""The job's `task` (EngineArgs.task: generate, embed, classify or score) and the sections of the prefill-only tasks:
`embed:`, `classify:` and `score:`, derived from PoolingParams' fields as `sampling:` is from SamplingParams' (a
field added there is a key here once it is named in TASK_FIELDS), plus score's job-only `continuation_column`.
A section belongs to its task: one written for another task is an error naming it, as is a `sampling:` key in a job
that generates nothing."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from batchgen.engine.errors import SettingError
from batchgen.engine.request import POOLINGS, TASKS, PoolingParams

from .keys import JobConfigError

GENERATE = "generate"
TaskName = Literal[TASKS]

# Each prefill-only task's section: the PoolingParams fields it sets. score_from is not a key: it is each row's
# (1 for a whole text, its context's length with score.continuation_column).
TASK_FIELDS = {"embed": ("pooling", "normalize", "dimensions", "truncate"), "classify": ("truncate",),
               "score": ("token_logprobs",)}

# Keys a section has that the engine does not (the job reads them).
JOB_ONLY_FIELDS = {"score": [("continuation_column", str | None, None)]}

# Narrower types than PoolingParams' hints, so that the key reader names the allowed values.
KEY_TYPES = {"pooling": Literal[POOLINGS] | None}


def _task_section(task: str) -> type:
    hints = typing.get_type_hints(PoolingParams)
    defaults = {f.name: f.default for f in dataclasses.fields(PoolingParams)}
    fields = [(name, KEY_TYPES.get(name, hints[name]), dataclasses.field(default=defaults[name]))
              for name in TASK_FIELDS[task]]
    fields += [(name, hint, dataclasses.field(default=default))
               for name, hint, default in JOB_ONLY_FIELDS.get(task, [])]
    return dataclasses.make_dataclass(f"{task.capitalize()}Config", fields, frozen=True,
                                      namespace={"__module__": __name__})


EmbedConfig = _task_section("embed")
ClassifyConfig = _task_section("classify")
ScoreConfig = _task_section("score")
TASK_SECTIONS = {"embed": EmbedConfig, "classify": ClassifyConfig, "score": ScoreConfig}


def pooling_params(section: Any, score_from: int = 1) -> PoolingParams:
    """A task section's values as the engine's PoolingParams (the job-only keys left out)."""
    engine_fields = {f.name for f in dataclasses.fields(PoolingParams)}
    values = {k: v for k, v in dataclasses.asdict(section).items() if k in engine_fields}
    return PoolingParams(**values, **({"score_from": score_from} if "score_from" in engine_fields else {}))


def check_task_sections(task: str, raw: dict[str, Any], sections: dict[str, Any]) -> None:
    """A section written for another task, or `sampling:` keys in a job that generates no text, is an error naming
    the key; the job's own section's values are checked (by PoolingParams.validate where the engine has it)."""
    for name in TASK_SECTIONS:
        if name != task and name in raw:
            raise JobConfigError(f"{name}: this section is for task: {name}, and the job's task is {task} "
                                 f"(set task: {name}, or remove the section)")
    sampling = raw.get("sampling")
    if task != GENERATE and isinstance(sampling, dict) and sampling:
        key = next(iter(sampling))
        raise JobConfigError(f"sampling.{key}: task: {task} generates no text, so sampling does not apply "
                             f"(remove the sampling section)")
    if task != GENERATE:
        _check_section(task, sections[task])


def _check_section(task: str, section: Any) -> None:
    values = dataclasses.asdict(section)
    if values.get("dimensions") is not None and values["dimensions"] < 1:
        raise JobConfigError(f"{task}.dimensions: must be at least 1, got {values['dimensions']}")
    column = values.get("continuation_column")
    if column is not None and not column.strip():
        raise JobConfigError(f"{task}.continuation_column: must be a column name, got an empty string")
    params = pooling_params(section)
    validate = getattr(params, "validate", None)  # the engine's own checks, where PoolingParams has them
    if validate is not None:
        try:
            validate()
        except SettingError as exc:
            message = str(exc)
            key = f"{task}.{exc.key}"
            raise JobConfigError(message if message.startswith(f"{key}:") else f"{key}: {message}") from None


def task_keys() -> dict[str, tuple[Any, bool]]:
    """The job file's keys for the task: `task` itself and one section per prefill-only task."""
    return {"task": (TaskName, False), **{name: (cls, False) for name, cls in TASK_SECTIONS.items()}}
