"""An OpenAI Batch input's custom_ids are unique, as OpenAI's Batch API requires: its results are matched to the
requests by custom_id, so a file holding one twice is refused before the model loads, naming the custom_id and the
two lines that hold it.

The check reads only the custom_id column of the staged Parquet copies (text_formats.py); where it finds a
duplicate, one more pass over the text files finds the lines."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .openai_batch import custom_id_text
from .parquet_read import InputFile
from .text_lines import numbered_lines

SEARCHED_IDS = 1000  # of the duplicated custom_ids, at most this many are looked for in the text files


class DuplicateCustomId(ValueError):
    """A custom_id on two lines of the input."""


def check_unique_custom_ids(sources: list[InputFile], staged: list[Path]) -> None:
    """Raise DuplicateCustomId naming the first custom_id (in file order) found a second time."""
    ids = pa.chunked_array([pq.read_table(path, columns=["custom_id"])["custom_id"] for path in staged],
                           pa.string())
    ids = pc.drop_null(ids)
    counts = pc.value_counts(ids)
    duplicated = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))
    if not len(duplicated):
        return
    searched = {value for value in duplicated[:SEARCHED_IDS].to_pylist() if value}
    if not searched:
        return  # only empty custom_ids, each already its request's error
    first, second = _first_repeat(sources, searched)
    raise DuplicateCustomId(f"custom_id {first[2]!r} is on {_where(first, second, len(sources) > 1)}; a batch "
                            f"holds each custom_id once, as OpenAI's Batch API requires (the results are matched to "
                            f"the requests by it)")


def _first_repeat(sources: list[InputFile], searched: set[str]) -> tuple[tuple, tuple]:
    """The two places (file, line, custom_id) of the first custom_id of `searched` seen a second time."""
    seen: dict[str, tuple] = {}
    for place in _places(sources, searched):
        if place[2] in seen:
            return seen[place[2]], place
        seen[place[2]] = place
    raise AssertionError("a duplicated custom_id was not found again in the files")


def _places(sources: list[InputFile], searched: set[str]) -> Iterator[tuple[InputFile, int, str]]:
    for source in sources:
        for line in numbered_lines(source):
            try:
                value = json.loads(line.text)
            except ValueError:
                continue
            custom_id = custom_id_text(value.get("custom_id")) if isinstance(value, dict) else None
            if custom_id in searched:
                yield source, line.number, custom_id


def _where(first: tuple, second: tuple, files: bool) -> str:
    if not files:
        return f"lines {first[1]} and {second[1]}"
    return f"line {first[1]} of {first[0]} and line {second[1]} of {second[0]}"
