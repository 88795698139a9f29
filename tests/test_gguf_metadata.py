"""gguf_has_key walks a GGUF's metadata without gguf.GGUFReader: every key of every value type is found, in either
byte order, a key that is not there is not, and metadata that cannot be read to its end is a ValueError."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from batchgen.models.gguf_metadata import gguf_has_key
from batchgen.models.loader import has_chat_template
from batchgen.models.named import NAMED_MODELS

ENTRIES = [  # one of each value type, arrays of fixed-size items, of strings and of arrays
    ("t.u8", 7, GGUFValueType.UINT8, None), ("t.i8", -7, GGUFValueType.INT8, None),
    ("t.u16", 7, GGUFValueType.UINT16, None), ("t.i16", -7, GGUFValueType.INT16, None),
    ("t.u32", 7, GGUFValueType.UINT32, None), ("t.i32", -7, GGUFValueType.INT32, None),
    ("t.f32", 0.5, GGUFValueType.FLOAT32, None), ("t.bool", True, GGUFValueType.BOOL, None),
    ("t.str", "héllo", GGUFValueType.STRING, None), ("t.u64", 7, GGUFValueType.UINT64, None),
    ("t.i64", -7, GGUFValueType.INT64, None), ("t.f64", 0.25, GGUFValueType.FLOAT64, None),
    ("t.ints", [1, 2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32),
    ("t.strs", ["a", "bc", ""], GGUFValueType.ARRAY, GGUFValueType.STRING),
    ("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY, GGUFValueType.ARRAY),
    ("tokenizer.chat_template", "{{ messages }}", GGUFValueType.STRING, None),
]


def write_gguf(path, endian=GGUFEndian.LITTLE, entries=ENTRIES):
    writer = GGUFWriter(path, "llama", endianess=endian)
    for key, value, kind, sub in entries:
        writer.add_key_value(key, value, kind, sub)
    writer.add_tensor("w", np.ones((2, 3), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
def test_every_key_is_found_and_no_other(tmp_path, endian):
    path = write_gguf(tmp_path / "m.gguf", endian)
    keys = [key for key in GGUFReader(path, "r").fields if not key.startswith("GGUF.")] if endian == GGUFEndian.LITTLE \
        else ["general.architecture"] + [key for key, *_ in ENTRIES]
    assert set(keys) >= {key for key, *_ in ENTRIES}
    assert all(gguf_has_key(path, key) for key in keys)
    assert not gguf_has_key(path, "t.missing") and not gguf_has_key(path, "t")


def test_a_chat_template_is_found_where_there_is_one(tmp_path):
    assert has_chat_template(NAMED_MODELS["default"].gguf("default"))
    assert has_chat_template(write_gguf(tmp_path / "chat.gguf"))
    assert not has_chat_template(write_gguf(tmp_path / "base.gguf", entries=ENTRIES[:-1]))


def test_metadata_that_cannot_be_read_to_its_end_is_an_error(tmp_path):
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in (0, 4, 20, 40, len(data) // 4):  # a string or array that runs past the end, or no header at all
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError):
            gguf_has_key(cut, "t.missing")
        assert has_chat_template(cut)  # the conversion names the problem
    cut.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40) + b"key")
    with pytest.raises(ValueError, match="runs past the end"):
        gguf_has_key(cut, "key")
