"""batchgen's cache of GGUF files converted to safetensors directories (BATCHGEN_CACHE_DIR/gguf, or
~/.cache/batchgen/gguf; the conversion, one tensor at a time into int8: gguf_convert.py), and the checked reads of
a model directory's files that the loader shares with it.

A converted GGUF carries a manifest of its files' sizes, written last; an entry that fails the cheap check (sizes,
safetensors headers) is converted again."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from batchgen_kernels.host import cache_root  # the one definition, shared with the kernels' build
from batchgen.user_files import (MODEL_CONFIG_LIMIT, TOKENIZER_FILE_LIMIT, UserFileError, check_regular_file,
                                 read_user_text)

from .registry import ModelError
from .safetensors_header import SafetensorsHeaderError, read_safetensors_header

logger = logging.getLogger("batchgen")

# Part of the conversion cache key: bump it when _convert_gguf's output changes, so old conversions are not reused.
CONVERSION_FORMAT = 2  # 2: int8 weights + scales (gguf_int8.py); 1: fp32
# A converted model's list of its files and their sizes, written last (json: {"files": {name: bytes}}).
CACHE_MANIFEST = "batchgen-manifest.json"

__all__ = ["CACHE_MANIFEST", "CONVERSION_FORMAT", "CacheDirError", "cache_root", "check_cache_can_take", "check_file",
           "converted_gguf", "is_cache_entry", "read_json", "writable_cache_dir"]


class CacheDirError(ModelError):
    """batchgen's cache directory (BATCHGEN_CACHE_DIR, or ~/.cache/batchgen) cannot be created or written."""


def writable_cache_dir(name: str) -> Path:
    """cache_root()/name, created if need be and checked writable: else a CacheDirError naming the setting."""
    setting = os.environ.get("BATCHGEN_CACHE_DIR")
    try:
        root = cache_root()
    except RuntimeError as exc:  # no HOME, and no passwd entry to find a home in
        raise CacheDirError(f"batchgen's cache directory cannot be found ({exc}); set BATCHGEN_CACHE_DIR") from None
    where = (f"BATCHGEN_CACHE_DIR={setting}" if setting else
             f"the cache directory {root} (~/.cache/batchgen; BATCHGEN_CACHE_DIR sets another)")
    directory = root / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        reason = (f"{root} is not a directory" if root.exists() and not root.is_dir() else
                  f"{directory} cannot be {'written' if directory.is_dir() else 'created'} ({exc.strerror or exc})")
        raise CacheDirError(f"{where} cannot hold converted models: {reason}; set BATCHGEN_CACHE_DIR to a writable "
                            f"directory") from None
    return directory


def check_cache_can_take(gguf: Path) -> None:
    """Nothing converted or written: the conversion of `gguf` is in the cache and passes its check, or the cache
    directory can take it (else a CacheDirError)."""
    if _entry_problem(_cache_entry(gguf)) is not None:
        writable_cache_dir("gguf")


def is_cache_entry(model_dir: Path) -> bool:
    try:
        return Path(model_dir).resolve().parent == (cache_root() / "gguf").resolve()
    except RuntimeError:  # no home directory: no default cache either
        return False


def converted_gguf(gguf: Path, int8: bool = True) -> Path:
    """The cached safetensors conversion of `gguf`, made on first use, and made again where the cached one fails
    its check. The write goes to a temp dir renamed into place, so concurrent processes never see (or leave) a
    half-written directory. `int8=False`: a plain fp32 checkpoint instead, which transformers and vLLM load (the
    bench's other systems, and the tests' references, run the same GGUF from it)."""
    target = _cache_entry(gguf, int8)
    problem = _entry_problem(target)
    if problem is None:
        logger.debug("using converted model %s (cache; safe to delete)", target)
        return target
    root = writable_cache_dir("gguf")
    if os.path.lexists(target):
        logger.warning("the converted model %s in batchgen's cache is damaged (%s); converting %s again",
                       target, problem, gguf)
        _discard(target, root)
    logger.info("converting %s once, one tensor at a time (int8 weights for batchgen's own architectures), into "
                "%s; later runs reuse it. Deleting %s is safe: it is rebuilt when needed.", gguf, target, root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        _convert_gguf(gguf.resolve(), tmp, int8)
        _write_manifest(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if _entry_problem(target) is not None:
                raise
            # Another process finished the same conversion first; use theirs.
    except OSError as exc:  # a full disk, a cache made read-only meanwhile
        raise CacheDirError(f"cannot write the conversion of {gguf} into {root}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _cache_entry(gguf: Path, int8: bool = True) -> Path:
    """Where the conversion of `gguf` is cached. The key covers the file's path, size and mtime, so a changed file
    gets a fresh conversion."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    form = CONVERSION_FORMAT if int8 else "fp32"
    key = hashlib.sha256(f"{form}\0{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}{'' if int8 else '-fp32'}"


def _write_manifest(entry: Path) -> None:
    files = {file.name: file.stat().st_size for file in sorted(entry.iterdir()) if file.is_file()}
    (entry / CACHE_MANIFEST).write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")


def _entry_problem(entry: Path) -> str | None:
    """What is wrong with a cached conversion, checked cheaply (no hashing), or None: with a manifest, every file
    it lists has its size; without one (written by an earlier version), config.json and tokenizer.json parse.
    Either way config.json is a JSON object and each safetensors header ends where its file ends."""
    if not os.path.lexists(entry):
        return "not converted yet"
    if not entry.is_dir():
        return "not a directory"
    try:
        if os.path.lexists(entry / CACHE_MANIFEST):
            files = read_json(entry / CACHE_MANIFEST).get("files")
            if not isinstance(files, dict) or not all(isinstance(size, int) for size in files.values()):
                return f"{CACHE_MANIFEST} is not a manifest"
            for name, size in files.items():
                actual = check_file(entry / name)
                if actual != size:
                    return f"{name} is {actual:,} bytes, {size:,} when it was written"
        elif os.path.lexists(entry / "tokenizer.json"):
            read_json(entry / "tokenizer.json", TOKENIZER_FILE_LIMIT)
        read_json(entry / "config.json")
        for file in sorted(entry.glob("*.safetensors")):
            problem = _safetensors_problem(file)
            if problem:
                return f"{file.name} {problem}"
    except ModelError as exc:
        return str(exc)
    return None


def _safetensors_problem(path: Path) -> str | None:
    """Whether the file's size is what its header says (8 bytes of header length, the JSON header, the data)."""
    size = check_file(path)
    try:
        header = read_safetensors_header(path)
        end = max((entry["data_offsets"][1] for entry in header.entries.values()), default=0)
    except SafetensorsHeaderError as exc:
        return "is cut short (no complete header)" if exc.reason == "bad header length" else "has a damaged header"
    except (KeyError, IndexError, TypeError, AttributeError):
        return "has a damaged header"
    if not isinstance(end, int):
        return "has a damaged header"
    if header.data_start + end != size:
        return f"is {size:,} bytes where its header says {header.data_start + end:,} (cut short or damaged)"
    return None


def _discard(entry: Path, root: Path) -> None:
    """Move a damaged entry out of the way (atomically: a concurrent run sees it or nothing), then delete it."""
    trash = Path(tempfile.mkdtemp(prefix=f".{entry.name}.damaged-", dir=root))
    try:
        os.replace(entry, trash / entry.name)
    except FileNotFoundError:
        pass  # another process moved it first
    except OSError as exc:
        raise CacheDirError(f"the damaged cache entry {entry} cannot be removed ({exc.strerror or exc}); "
                            f"delete it") from None
    finally:
        shutil.rmtree(trash, ignore_errors=True)


def _convert_gguf(gguf: Path, out_dir: Path, int8: bool) -> None:
    from .gguf_convert import convert_gguf  # deferred: numpy, gguf and the model classes, for a conversion only

    convert_gguf(gguf, out_dir, int8)


def check_file(path: Path, limit: int | None = None) -> int:
    """The size of a model directory's file, once it is found a regular file under `limit`; else a ModelError."""
    try:
        return check_regular_file(path, limit)
    except UserFileError as exc:
        raise ModelError(str(exc)) from None


def read_json(path: Path, limit: int = MODEL_CONFIG_LIMIT) -> dict:
    """A model directory's JSON object file, read after the regular-file and size checks."""
    try:
        value = json.loads(read_user_text(path, limit))
    except UserFileError as exc:
        raise ModelError(str(exc)) from None
    except ValueError as exc:
        raise ModelError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path} is not a JSON object")
    return value
