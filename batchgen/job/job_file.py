"""Reading the job file: its YAML text into a raw mapping (a key given twice, or nesting deeper than a job may be,
refused with the line it is on), with the `--set key.path=value` overrides applied. config.py checks the mapping."""
from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

import yaml

from batchgen.user_files import JOB_FILE_LIMIT, UserFileError, read_user_text

from .keys import MAX_JOB_DEPTH, JobConfigError, job_key


def read_job_file(path: Path, overrides: typing.Sequence[str] = ()) -> dict[str, Any]:
    """The job file's raw mapping, with `--set key.path=value` overrides applied; its values are not checked yet."""
    if not os.path.lexists(path):
        raise JobConfigError(f"job file not found: {path}")
    try:
        text = read_user_text(path, JOB_FILE_LIMIT)
    except UserFileError as exc:
        raise JobConfigError(f"job file: {exc}") from None
    try:
        raw = yaml.load(text, Loader=_JobLoader)
    except _TooDeep as exc:
        raise JobConfigError(f"{exc.key}: nested more than {MAX_JOB_DEPTH} levels deep ({path}, line "
                             f"{exc.mark.line + 1})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise JobConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobConfigError(f"{path}: the job file must be a mapping of keys, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    return raw


class _TooDeep(yaml.YAMLError):
    """A job file nested deeper than MAX_JOB_DEPTH, under job key `key`."""

    def __init__(self, key: str, mark):
        super().__init__(key)
        self.key, self.mark = key, mark


class _JobLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last one silently) and
    nesting deeper than a job's values may be (YAML's composer recurses once per level)."""

    def compose_node(self, parent, index):
        # a mapping's value is composed with its key's node as `index`, a list's item with its position
        path = self.__dict__.setdefault("_path", [])
        path.append(f".{index.value}" if isinstance(index, yaml.ScalarNode) else f"[{index}]")
        try:
            if len(path) > MAX_JOB_DEPTH + 1:
                raise _TooDeep(job_key("".join(path[1:]).lstrip(".")), self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            path.pop()

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                if key not in seen:
                    seen[key] = key_node.start_mark.line
                    continue
            except TypeError:  # an unhashable key: the mapping's own construction reports it
                continue
            first = seen[key]
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (lines {first + 1} and {key_node.start_mark.line + 1})",
                key_node.start_mark)
        return super().construct_mapping(node, deep)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `a.b=value` to the raw mapping; the value is parsed as a YAML scalar (64 -> int, null -> None)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise JobConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. engine.max_num_seqs=64")
    try:
        value = yaml.load(text, Loader=_JobLoader) if text.strip() else None
    except yaml.YAMLError:
        value = text
    if isinstance(value, dict):  # "Be brief: answer" is text, not a mapping; lists ([a, b]) stay lists
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for depth, part in enumerate(parents):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise JobConfigError(f"--set {key}: {'.'.join(parents[:depth + 1])} is not a section")
        node = child
    node[leaf] = value
