"""`model: s3://bucket/prefix/` — a Hugging Face model directory kept in object storage, downloaded once into
batchgen's cache (BATCHGEN_CACHE_DIR/object-models) and reused while its objects stay the same.

The cache entry's name holds a digest of the prefix's listing (each object's key, size and ETag), so an object
rewritten in the store is another entry, and the entry's path, which the job's fingerprint holds, pins the version
a run used. An entry is downloaded into a scratch directory beside it, each file checked against its listed size,
then renamed into place: a killed download leaves no entry, only scratch that the next download removes. A reused
entry is checked against its manifest (every file there, at its size) before it is trusted.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from batchgen.object_store import StorageConfig, make_store, split_url, store_error

from .gguf_cache import writable_cache_dir
from .registry import ModelError

MANIFEST = "batchgen-object-manifest.json"


def fetch_model(url: str, storage: StorageConfig, marker: str = "config.json",
                what: str = "a Hugging Face model directory") -> Path:
    """The local directory holding the model at `url` (downloaded now unless the cache has this version). `marker`:
    the file that makes the prefix `what` it must be (a LoRA adapter's is adapter_config.json)."""
    import obstore

    store = make_store(url, storage)
    scheme, bucket, key = split_url(url)
    prefix = key.rstrip("/") + "/" if key else ""
    try:
        listing = sorted(((meta["path"][len(prefix):], meta["size"], meta.get("e_tag"))
                          for chunk in obstore.list(store, prefix=prefix or None) for meta in chunk),
                         key=lambda entry: entry[0])
    except Exception as exc:
        raise store_error(exc, url) from None
    listing = [entry for entry in listing if entry[0] and not entry[0].endswith("/")]
    if not any(name == marker for name, _, _ in listing):
        raise ModelError(f"{url} holds no {marker} ({what} is expected under the prefix)")
    source = f"{scheme}{bucket}/{prefix}"  # s3://b/m and s3://b/m/ are one model
    digest = hashlib.sha256(json.dumps([source, listing]).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{bucket}-{prefix}").strip("-")[:80]
    root = writable_cache_dir("object-models")
    entry = root / f"{slug}-{digest}"
    files = {name: size for name, size, _ in listing}
    if _complete(entry, files):
        return entry
    scratch = root / f".{entry.name}.download"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(entry, ignore_errors=True)  # damaged: downloaded again
    for name, size, _ in listing:
        target = scratch / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(target, "wb") as out:
                for chunk in obstore.get(store, prefix + name).stream(min_chunk_size=8 << 20):
                    out.write(chunk)
        except Exception as exc:
            shutil.rmtree(scratch, ignore_errors=True)
            raise store_error(exc, f"{scheme}{bucket}/{prefix}{name}") from None
        if target.stat().st_size != size:
            shutil.rmtree(scratch, ignore_errors=True)
            raise ModelError(f"{scheme}{bucket}/{prefix}{name}: downloaded {target.stat().st_size} bytes, the store "
                             f"listed {size}; run again")
    (scratch / MANIFEST).write_text(json.dumps({"url": source, "files": files}))
    scratch.rename(entry)
    return entry


def _complete(entry: Path, files: dict[str, int]) -> bool:
    """Whether the cache entry holds every file of its manifest at its size (and the manifest is this listing's)."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("files") == files and all(
        (entry / name).is_file() and (entry / name).stat().st_size == size for name, size in files.items())
