"""The lines of a text input file (gzipped too, local or in object storage), numbered from 1 and each decoded on its
own: a byte that is not UTF-8 is its line's problem (that row's error), not the whole file's."""
from __future__ import annotations

import codecs
import gzip
import io
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from batchgen.object_store import RemoteFile

from .parquet_read import InputFile


@dataclass(frozen=True, slots=True)
class Line:
    number: int
    text: str  # where `not_utf8` is set, the line with each byte that is not UTF-8 replaced by U+FFFD
    not_utf8: str | None = None  # why the line is not UTF-8, e.g. "invalid start byte at byte 12"


def numbered_lines(path: InputFile) -> Iterator[Line]:
    """Every line, its end kept (a CSV reader needs it); a byte-order mark before the first line is dropped
    (spreadsheets write one before a CSV's header)."""
    with open_binary(path) as raw:
        for number, data in enumerate(raw, 1):
            if number == 1 and data.startswith(codecs.BOM_UTF8):
                data = data[len(codecs.BOM_UTF8):]
            try:
                yield Line(number, data.decode("utf-8"))
            except UnicodeDecodeError as exc:
                yield Line(number, data.decode("utf-8", "replace"), f"{exc.reason} at byte {exc.start + 1}")


@contextmanager
def open_binary(path: InputFile) -> Iterator[IO[bytes]]:
    """The file's bytes, buffered (an object is read in ranges) and decompressed; closed, the object too, on exit."""
    raw = path.open() if isinstance(path, RemoteFile) else open(Path(path), "rb")
    try:
        buffered = raw if isinstance(raw, io.BufferedIOBase) else io.BufferedReader(raw)
        with gzip.GzipFile(fileobj=buffered) if str(path).lower().endswith(".gz") else buffered as readable:
            yield readable
    finally:
        raw.close()
