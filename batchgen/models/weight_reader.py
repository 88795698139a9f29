"""Read safetensors tensors into memory the process owns, one at a time, without mapping the file.

safe_open's get_tensor returns a view of the memory-mapped shard: every page it (or a cast, or a concatenation)
reads stays resident while the mapping lives, so a loaded model held its checkpoint beside its own copies. Here each
tensor is read with plain file reads straight into its destination (a slice of a fused weight, or a small buffer
that is cast into it), so the page cache holds the file and the process holds only the weights.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .safetensors_header import read_safetensors_header

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class ShardReader:
    """One open shard: its header (name → dtype, shape, byte range) and an unbuffered file to read from."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = open(self.path, "rb", buffering=0)
        try:
            header = read_safetensors_header(self.path, self.file)
        except BaseException:
            self.file.close()
            raise
        self.base = header.data_start
        self.entries = header.entries

    def keys(self):
        return self.entries.keys()

    def info(self, name: str) -> tuple[torch.dtype, list[int]]:
        entry = self.entries[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has dtype {entry['dtype']}, which batchgen cannot read")
        return _DTYPES[entry["dtype"]], entry["shape"]

    def read_into(self, name: str, out: torch.Tensor, staging: Staging | None = None) -> None:
        """Fill `out` (contiguous, CPU) with tensor `name`, casting when its dtype differs (through `staging` when
        given, else a new buffer)."""
        dtype, shape = self.info(name)
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name} has shape {shape}, expected {list(out.shape)}")
        target = out
        if out.dtype != dtype:
            target = staging.take(shape, dtype) if staging is not None else torch.empty(shape, dtype=dtype)
        start, end = self.entries[name]["data_offsets"]
        view = target.view(-1).view(torch.uint8).numpy() if target.numel() else memoryview(b"")
        if len(view) != end - start:
            raise ValueError(f"{self.path}: tensor {name} spans {end - start} bytes, its dtype and shape {len(view)}")
        self.file.seek(self.base + start)
        done = 0
        while done < len(view):
            n = self.file.readinto(memoryview(view)[done:])
            if not n:
                raise ValueError(f"{self.path}: truncated in tensor {name}")
            done += n
        if target is not out:
            out.copy_(target)

    def close(self) -> None:
        self.file.close()


class Staging:
    """One reusable buffer for tensors that live only until the next read: a cast's source, or a plain weight that
    is packed or quantized as soon as it is read. Each new buffer costs the first touch of its pages (~0.65 s per GiB
    on this project's machines, against ~0.1 s to refill touched memory), which made up most of a 1B fp32 model's
    load; one buffer, grown to the largest such tensor, pays it once."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over the buffer; valid until the next take."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(0, dtype=torch.uint8)  # the old one goes back before the new one is made
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).view(tuple(shape))
