"""Hugging Face hub ids as models: `org/name` or `org/name@revision` (a branch, tag or commit hash), found in the
local Hugging Face cache and downloaded with huggingface_hub when the cache lacks them and the machine may go
online. A resolved model is a snapshot directory, <cache>/models--org--name/snapshots/<commit>/, whose name is the
commit a job's fingerprint pins (`org/name@<commit>`).

The cache is the one huggingface_hub uses: HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub. It is
read from the environment at each call (huggingface_hub reads it once, at import)."""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .checkpoint_files import CHAT_TEMPLATES, MODEL_FILE_LIMITS, indexed_shards, weight_files
from .registry import ModelError, ModelNotFoundError

logger = logging.getLogger("batchgen")

# org/name, then optionally @ and a git revision (a ref name may hold slashes: refs/pr/1)
_HUB_ID = re.compile(r"(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<revision>[\w.-]+(?:/[\w.-]+)*))?")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a true environment variable


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None  # None: the repository's main branch

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    def pinned(self, snapshot: Path) -> str:
        """`org/name@<commit>`: the id at the commit of a snapshot directory this id resolved to."""
        return f"{self.repo_id}@{Path(snapshot).name}"


def parse_hub_id(ref: str) -> HubId | None:
    """`ref` as a hub id, or None: a path that exists is a path, and a name ending in .gguf is a file."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    match = _HUB_ID.fullmatch(ref)
    if match is None or os.path.lexists(ref) or ref.endswith(".gguf") or ".." in (match["revision"] or ""):
        return None
    try:
        validate_repo_id(match["repo"])
    except HFValidationError:
        return None
    return HubId(match["repo"], match["revision"])


def hub_cache() -> tuple[Path, str]:
    """The hub cache directory, and what chose it."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return _expand(os.environ[name]), f"set by {name}"
    if os.environ.get("HF_HOME"):
        return _expand(os.environ["HF_HOME"]) / "hub", "set by HF_HOME"
    if os.environ.get("XDG_CACHE_HOME"):
        return _expand(os.environ["XDG_CACHE_HOME"]) / "huggingface" / "hub", "set by XDG_CACHE_HOME"
    return Path.home() / ".cache" / "huggingface" / "hub", "the default cache; HF_HUB_CACHE or HF_HOME sets another"


def _expand(value: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(value)))


def offline_setting() -> str | None:
    """The environment variable that forbids going online (`HF_HUB_OFFLINE=1`), or None."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").upper() in _TRUE:
            return f"{name}={os.environ[name]}"
    return None


def hub_snapshot(hub: HubId, no_download_because: str | None = None) -> Path:
    """The snapshot directory of `hub`: from the cache when it holds the config and every weight file, else
    downloaded (only the files batchgen reads). `no_download_because`: why this caller must not download, or None.
    Else a ModelNotFoundError naming the id, where it looked and why it did not download."""
    from huggingface_hub.file_download import repo_folder_name

    cache, setting = hub_cache()
    snapshot, problem = cached_snapshot(hub, cache)
    if problem is None:
        return snapshot
    offline = offline_setting()
    reason = f"{offline} forbids downloading it" if offline else no_download_because
    if reason is None:
        try:
            return download_snapshot(hub, cache)
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as exc:  # huggingface_hub raises many types: no network, no such repo, gated, disk full
            text = str(exc).strip().splitlines()
            reason = f"downloading it failed ({type(exc).__name__}{': ' + text[0] if text else ''})"
    if snapshot is not None:
        raise ModelNotFoundError(f"{str(hub)!r} {problem}; {reason}")
    looked = cache / repo_folder_name(repo_id=hub.repo_id, repo_type="model")
    raise ModelNotFoundError(f"{str(hub)!r} not found: no such local path, and not in the Hugging Face cache "
                             f"(looked in {looked}, {setting}); {reason}")


def cached_snapshot(hub: HubId, cache: Path) -> tuple[Path | None, str | None]:
    """(the snapshot directory, None) when the cache holds a complete one; else (it or None, what is wrong with it:
    incomplete or damaged)."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(hub.repo_id, "config.json", cache_dir=cache, revision=hub.revision)
    snapshot = Path(config).parent if isinstance(config, str) else snapshot_dir(hub, cache)
    damage = dangling_link(snapshot) if snapshot is not None else None
    if damage is not None:
        link, target = damage
        return snapshot, (f"is damaged in the Hugging Face cache: {link} links to {target}, which does not exist "
                          f"(a download cut short, or a blob deleted); delete {snapshot} and download it again")
    if not isinstance(config, str):  # None, or huggingface_hub's marker of a file known not to exist
        return None, "not in the cache"
    try:
        if not weight_files(snapshot):
            return snapshot, f"is incomplete in the Hugging Face cache ({snapshot} has no *.safetensors weights)"
    except ModelError as exc:
        return snapshot, f"is incomplete in the Hugging Face cache ({exc})"
    return snapshot, None


def snapshot_dir(hub: HubId, cache: Path) -> Path | None:
    """The snapshot directory `hub`'s revision names (refs/<revision> holds a branch's or tag's commit), where it
    exists."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=hub.repo_id, repo_type="model")
    revision = hub.revision or "main"
    try:
        ref = repo / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if "/" not in commit and snapshot.is_dir() else None


def dangling_link(snapshot: Path) -> tuple[Path, str] | None:
    """A file of the snapshot that is a link to a blob that is not there: (the link, its target), or None."""
    try:
        for entry in sorted(snapshot.rglob("*")):
            if entry.is_symlink() and not entry.exists():
                return entry, os.readlink(entry)
    except OSError:
        return None
    return None


def download_snapshot(hub: HubId, cache: Path) -> Path:
    """Config, tokenizer and index first, then, at the commit they came from, the shards the index names (or
    model.safetensors): never a repository's other weights (a consolidated copy, PyTorch .bin files)."""
    from huggingface_hub import snapshot_download

    logger.info("downloading %s from the Hugging Face hub into %s", hub, cache)
    small = [*MODEL_FILE_LIMITS, CHAT_TEMPLATES]
    snapshot = Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=cache, allow_patterns=small))
    shards = indexed_shards(snapshot) or ["model.safetensors"]
    snapshot = Path(snapshot_download(hub.repo_id, revision=snapshot.name, cache_dir=cache, allow_patterns=shards))
    _, problem = cached_snapshot(HubId(hub.repo_id, snapshot.name), cache)
    if problem is not None:
        raise ModelError(f"after the download to {snapshot}, {str(hub)!r} {problem}")
    return snapshot
