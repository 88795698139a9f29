"""`open_output`: the one place a job's output becomes one kind of store or the other (store.py), by its path."""
from __future__ import annotations

from batchgen.object_store import StorageConfig, is_remote

from .object_output import ObjectOutput
from .output_dir import OutputDir
from .store import OutputStore


def open_output(path: str, storage: StorageConfig) -> OutputStore:
    """`s3://...` (and the other object-store schemes): an ObjectOutput; anything else a local OutputDir."""
    return ObjectOutput(path, storage) if is_remote(path) else OutputDir(path)
