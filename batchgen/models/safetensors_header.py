"""The one reader of a .safetensors file's header: 8 bytes of little-endian length, then that many bytes of JSON
(tensor name -> dtype, shape, data_offsets; and an optional __metadata__). No tensor data is read.

The model inspector (inspector.py: the model's description, `batchgen plan`'s weight bytes), the weight reader (the
byte range of each tensor) and the GGUF cache's damage check (gguf_cache.py) all read headers through it."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# safetensors refuses headers above 100 MB; a length field above that is damage.
MAX_HEADER_BYTES = 100 * 2**20


class SafetensorsHeaderError(ValueError):
    """Not a readable safetensors header; `reason` is "bad header length" or "its header is not JSON"."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} is not a safetensors file ({reason})")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class SafetensorsHeader:
    entries: dict[str, dict]  # tensor name -> {"dtype", "shape", "data_offsets"}, __metadata__ left out
    data_start: int  # the offset of the tensor data in the file: 8 + the header's length


def read_safetensors_header(path: Path, file: BinaryIO | None = None) -> SafetensorsHeader:
    """The header of the file at `path` (read from `file` when given: it is left open, after the header); a
    SafetensorsHeaderError for a length past the file or past MAX_HEADER_BYTES, or a header that is not a JSON
    object."""
    if file is None:
        with open(path, "rb") as opened:
            return read_safetensors_header(path, opened)
    head = file.read(8)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 < length <= min(os.fstat(file.fileno()).st_size - 8, MAX_HEADER_BYTES):
        raise SafetensorsHeaderError(Path(path), "bad header length")
    try:
        header = json.loads(file.read(length))
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(Path(path), "its header is not JSON")
    header.pop("__metadata__", None)
    return SafetensorsHeader(header, 8 + length)
