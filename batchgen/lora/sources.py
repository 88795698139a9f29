"""Where a job's adapter is (`lora: {name: ref}`): a local directory, a Hugging Face hub id (org/name or
org/name@revision, from the HF cache or downloaded: its two adapter files only), or an s3:// prefix (downloaded once
into batchgen's cache, as a model in object storage is). Each becomes a local directory and an identity that pins
it for the job's fingerprint: the hub commit or the cache entry, and a digest of the two files, so that an adapter
rewritten in place is another job (a resume refuses it)."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from batchgen.models.hub import HubId, hub_cache, offline_setting, parse_hub_id
from batchgen.models.registry import ModelError
from batchgen.object_store import StorageConfig, is_remote

from .adapter import CONFIG_FILE, WEIGHTS_FILE

logger = logging.getLogger("batchgen.lora")
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


@dataclass(frozen=True)
class LocatedAdapter:
    path: Path  # the local directory the engine reads
    source: str  # what pins it: the resolved path, org/name@<commit>, or the object-store cache entry
    sha256: str  # of its two files, config then weights
    nbytes: int  # its weights file's size

    def identity(self) -> dict:
        return {"source": self.source, "sha256": self.sha256}


def locate_adapter(ref: str, storage: StorageConfig, no_download_because: str | None = None) -> LocatedAdapter:
    """The adapter `ref` names as a local directory holding both its files; a ModelError saying what is missing."""
    if is_remote(ref):
        from batchgen.models.object_model import fetch_model

        path = fetch_model(ref, storage, marker=CONFIG_FILE, what="a PEFT LoRA adapter")
        source = str(path)
    elif (hub := parse_hub_id(ref)) is not None:
        path = _hub_adapter(hub, no_download_because)
        source = hub.pinned(path)
    else:
        path = Path(ref).expanduser()
        if not path.is_dir():
            raise ModelError(f"{ref} is not a directory (expected a PEFT adapter directory, a hub id org/name or an "
                             f"s3:// prefix)")
        source = str(path.resolve())
    missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    if missing:
        raise ModelError(f"{ref}: no {' and no '.join(missing)} in {path} (a PEFT LoRA adapter directory has both)")
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        with open(path / name, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
    return LocatedAdapter(path, source, digest.hexdigest(), (path / WEIGHTS_FILE).stat().st_size)


def _hub_adapter(hub: HubId, no_download_because: str | None) -> Path:
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    cache, setting = hub_cache()
    found = [try_to_load_from_cache(hub.repo_id, name, cache_dir=cache, revision=hub.revision)
             for name in ADAPTER_FILES]
    if all(isinstance(file, str) for file in found):
        return Path(found[0]).parent
    offline = offline_setting()
    reason = f"{offline} forbids downloading it" if offline else no_download_because
    if reason is None:
        try:
            logger.info("downloading adapter %s from the Hugging Face hub into %s", hub, cache)
            return Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=cache,
                                          allow_patterns=list(ADAPTER_FILES)))
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as exc:  # huggingface_hub raises many types: no network, no such repo, gated, disk full
            text = str(exc).strip().splitlines()
            reason = f"downloading it failed ({type(exc).__name__}{': ' + text[0] if text else ''})"
    raise ModelError(f"{str(hub)!r}: not a local directory, and not in the Hugging Face cache ({cache}, {setting}); "
                     f"{reason}")
