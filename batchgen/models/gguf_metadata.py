"""Whether a GGUF file's metadata holds a key, found by walking the key/value entries and skipping their values
(gguf.GGUFReader builds numpy views of every entry, ~100,000 for a 49k-token vocabulary: seconds per call)."""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

# GGUF value types (gguf.GGUFValueType) of a fixed size, and that size in bytes
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def gguf_has_key(path: Path, key: str) -> bool:
    """Whether the metadata of the GGUF (version 2 or 3, either byte order) at `path` has `key`; ValueError when
    the metadata cannot be read to the end of its entries (not a GGUF file, or a damaged one)."""
    wanted = key.encode()
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        order = _byte_order(data)
        entries = _unpack(data, 16, order, "Q")
        offset = 24
        for _ in range(entries):
            name, offset = _string(data, offset, order)
            if name == wanted:
                return True
            kind = _unpack(data, offset, order, "I")
            offset = _skip_value(data, offset + 4, kind, order)
    return False


def _byte_order(data) -> str:
    if data[:4] != b"GGUF":
        raise ValueError("no GGUF magic bytes")
    for order in "<>":
        if _unpack(data, 4, order, "I") in (2, 3):
            return order
    raise ValueError("unknown GGUF version")


def _unpack(data, offset: int, order: str, code: str) -> int:
    try:
        return struct.unpack_from(order + code, data, offset)[0]
    except struct.error:
        raise ValueError(f"GGUF metadata cut short at byte {offset}") from None


def _string(data, offset: int, order: str) -> tuple[bytes, int]:
    length = _unpack(data, offset, order, "Q")
    end = offset + 8 + length
    if end > len(data):
        raise ValueError(f"GGUF string at byte {offset} runs past the end of the file")
    return data[offset + 8:end], end


def _skip_value(data, offset: int, kind: int, order: str) -> int:
    """The offset after a value of type `kind` that starts at `offset`."""
    if kind in _FIXED_SIZES:
        return offset + _FIXED_SIZES[kind]
    if kind == _STRING:
        return offset + 8 + _unpack(data, offset, order, "Q")
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind} at byte {offset}")
    item_kind, count = _unpack(data, offset, order, "I"), _unpack(data, offset + 4, order, "Q")
    offset += 12
    if item_kind in _FIXED_SIZES:
        end = offset + count * _FIXED_SIZES[item_kind]
        if end > len(data):
            raise ValueError(f"GGUF array at byte {offset} runs past the end of the file")
        return end
    for _ in range(count):  # strings or arrays: each is at least 8 bytes, so a damaged count ends at the file's end
        offset = _skip_value(data, offset, item_kind, order)
        if offset > len(data):
            raise ValueError(f"GGUF array at byte {offset} runs past the end of the file")
    return offset
