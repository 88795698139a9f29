"""Object storage — `s3://bucket/key`, `gs://`, `az://` — through obstore (the `s3` extra): list what an input path
names, read an object's byte ranges as a file pyarrow can take, and say what makes an object the same object for a
resume (its size and ETag).

Why obstore (docs/object-storage.md, "The library, by measurement"): it is the one of pyarrow's S3FileSystem, fsspec
+ s3fs and obstore that does both conditional writes the output's commit protocol needs (create only if absent,
If-None-Match; replace only the version read, If-Match), it wrote parts fastest, and it reads row groups by range.

Credentials and endpoints come from the standard places: the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION / AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL), else the AWS SDKs'
credential chain (aws_credentials.py: the profile AWS_PROFILE names, with its region and endpoint_url; assume-role,
credential_process, SSO, web identity, the container's or instance's metadata service); the job's `storage:` section
sets what a pipeline sets per job (endpoint, region, anonymous access, addressing style). No message batchgen writes
holds a credential: `redact` (redaction.py) removes them, and URLs' userinfo and secret query parameters, from any
text that reaches an error or a log.
"""
from __future__ import annotations

import fnmatch
import importlib.util
import io
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from batchgen.aws_credentials import aws_profile, credential_provider
from batchgen.redaction import redact, remember_url

SCHEMES = ("s3://", "gs://", "az://")


@dataclass(frozen=True)
class StorageConfig:
    """The job's `storage:` section: how to reach an S3-compatible store (every key optional)."""

    endpoint_url: str | None = None  # an S3-compatible store's URL; default AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL
    region: str | None = None  # default AWS_REGION / AWS_DEFAULT_REGION
    anonymous: bool = False  # unsigned requests (public buckets)
    addressing_style: Literal["auto", "path", "virtual"] = "auto"  # auto: virtual on AWS, path on an endpoint_url
    max_retries: int = 5  # per request, with exponential backoff, then the run fails (exit 1) and resumes later
    timeout_s: float = 60.0  # per request
    lease_ttl_s: float = 60.0  # an s3:// output's lease: refreshed every third of this; a killed run's, stale after it


class StoreError(Exception):
    """The store could not be reached or refused a request past its retries: a runtime failure (exit 1), whose
    committed rows a re-run keeps. The message names the store and object, never a credential."""


class ObjectNotFound(StoreError):
    """No object at the path."""


class BucketNotFound(StoreError):
    """The bucket a URL names does not exist: a problem with the job (the job layer names its key; exit 2)."""

    def __init__(self, url: str) -> None:
        self.url, self.bucket = url, split_url(url)[1]
        super().__init__(f"the bucket {self.bucket} does not exist ({url})")


def is_remote(path: str) -> bool:
    return str(path).startswith(SCHEMES)


def obstore_missing(key: str, url: str) -> str | None:
    """The message for a job that names `url` at `key` where obstore is not installed; None where it is."""
    if importlib.util.find_spec("obstore") is not None:
        return None
    return (f"{key}: {url} needs obstore, which is not installed: pip install -e \".[s3]\" in batchgen's checkout "
            f"(scripts/setup.sh installs it)")


def split_url(url: str) -> tuple[str, str, str]:
    """("s3://", bucket, key) of an object-store URL."""
    scheme = next(s for s in SCHEMES if url.startswith(s))
    bucket, _, key = url[len(scheme):].partition("/")
    return scheme, bucket, key


@dataclass(frozen=True)
class RemoteFile:
    """One object of the input: its URL, size and ETag as listed, and the store to read it from (picklable: Ray
    replicas get it with their window)."""

    url: str
    size: int
    etag: str | None
    store: Any = field(compare=False, repr=False)
    modified: float | None = field(default=None, compare=False)  # Last-Modified as listed (epoch seconds)

    def __str__(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    def identity(self) -> dict[str, Any]:
        """What makes it the same object for a resume, asked of the store now (a rewritten object gets a new ETag):
        at the start of a run, and again at its end to catch an object rewritten while it ran."""
        import obstore

        try:
            meta = obstore.head(self.store, split_url(self.url)[2])
        except Exception as exc:
            raise store_error(exc, self.url) from None
        return {"size": meta["size"], "etag": meta.get("e_tag")}

    def open(self) -> io.RawIOBase:
        """The object as a seekable file that reads byte ranges on demand (never the whole object up front)."""
        import obstore

        try:
            return RangeReader(obstore.open_reader(self.store, split_url(self.url)[2], buffer_size=1 << 20),
                                self.url)
        except Exception as exc:
            raise store_error(exc, self.url) from None


def make_store(url: str, storage: StorageConfig) -> Any:
    """An obstore store for the bucket of `url`."""
    from obstore.store import AzureStore, GCSStore, S3Store  # callers check it is installed (obstore_missing)

    scheme, bucket, _ = split_url(url)
    retry = {"max_retries": storage.max_retries, "retry_timeout": timedelta(seconds=storage.timeout_s * 3),
             "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15),
                         "base": 2}}
    client = {"timeout": timedelta(seconds=storage.timeout_s), "connect_timeout": timedelta(seconds=10)}
    if scheme == "gs://":
        return GCSStore(bucket, client_options=client, retry_config=retry)
    if scheme == "az://":
        return AzureStore(bucket, client_options=client, retry_config=retry)
    env_keys = bool(os.environ.get("AWS_ACCESS_KEY_ID"))  # the environment's keys come first, read by obstore
    profile = {} if env_keys else aws_profile()
    endpoint = storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") \
        or profile.get("endpoint_url")
    remember_url(endpoint)
    config: dict[str, Any] = {}
    if endpoint:
        config["endpoint"] = endpoint
        client["allow_http"] = endpoint.startswith("http://")
    region = storage.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") \
        or profile.get("region")
    if region:
        config["region"] = region
    if storage.anonymous:
        config["skip_signature"] = True
    style = storage.addressing_style if storage.addressing_style != "auto" else "path" if endpoint else "virtual"
    config["virtual_hosted_style_request"] = style == "virtual"
    provider = None if env_keys or storage.anonymous else chain_provider()
    return S3Store(bucket, config=config, client_options=client, retry_config=retry, credential_provider=provider)


def chain_provider() -> Any:
    """The AWS credential chain's provider (aws_credentials.py), a profile it cannot use being a StoreError."""
    try:
        return credential_provider()
    except Exception as exc:
        raise StoreError(f"AWS credentials: {redact(' '.join(str(exc).split()))[:400]}") from None


def list_input(path: str, storage: StorageConfig, names: tuple[str, ...] = (".parquet",)) -> list[RemoteFile]:
    """The input objects `path` names, sorted by URL: one object; a prefix (its objects ending in one of `names`,
    *.parquet by default, at any depth,
    skipping names under a part that starts with `.` or `_`, as pyarrow does); or a glob whose matches are objects
    or prefixes (hive partitions: s3://bucket/data/date=2026-*). An empty result is the caller's to refuse."""
    import obstore

    store = make_store(path, storage)
    scheme, bucket, key = split_url(path)
    root = f"{scheme}{bucket}/"
    magic = any(c in key for c in "*?[")
    try:
        if not magic:
            try:
                meta = obstore.head(store, key)
                return [RemoteFile(root + meta["path"], meta["size"], meta.get("e_tag"), store)] if key else []
            except FileNotFoundError:
                pass
            except Exception as exc:
                if not is_not_found(exc):
                    raise
            prefix = key.rstrip("/") + "/" if key else ""
            return [RemoteFile(root + m["path"], m["size"], m.get("e_tag"), store)
                    for m in list_objects(store, prefix) if _is_input_object(m["path"][len(prefix):], names)]
        fixed = key[:min(key.index(c) for c in "*?[" if c in key)].rpartition("/")[0]
        pattern = tuple(key.split("/"))
        found = []
        for meta in list_objects(store, fixed + "/" if fixed else ""):
            parts = tuple(meta["path"].split("/"))
            for depth in range(len(parts), 0, -1):  # the object itself, or a prefix above it, matches the glob
                if glob_matches(pattern, parts[:depth]) and (
                        depth == len(parts) or _is_input_object("/".join(parts[depth:]), names)):
                    found.append(RemoteFile(root + meta["path"], meta["size"], meta.get("e_tag"), store))
                    break
        return sorted(found, key=lambda f: f.url)
    except StoreError:
        raise
    except Exception as exc:
        raise store_error(exc, path) from None


def list_objects(store: Any, prefix: str) -> list[dict[str, Any]]:
    import obstore

    return sorted((meta for chunk in obstore.list(store, prefix=prefix or None) for meta in chunk),
                  key=lambda meta: meta["path"])


def _is_input_object(relative: str, names: tuple[str, ...]) -> bool:
    parts = relative.split("/")
    return parts[-1].lower().endswith(names) and not any(part.startswith((".", "_")) for part in parts)


def glob_matches(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether glob.glob(pattern, recursive=True) would match the path `parts`, one component at a time."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(glob_matches(rest, parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], head) and glob_matches(rest, parts[1:])


def is_not_found(exc: BaseException) -> bool:
    """No object at the key (a missing bucket is not that: store_error names it)."""
    return (isinstance(exc, FileNotFoundError) or type(exc).__name__ == "NotFoundError") \
        and not is_missing_bucket(exc)


def is_missing_bucket(exc: BaseException) -> bool:
    """S3's NoSuchBucket, which obstore reports as a missing object (a GET, a PUT) or a generic error (a listing);
    a HEAD's answer has no body to tell it by."""
    return "<Code>NoSuchBucket</Code>" in str(exc)


def store_error(exc: BaseException, url: str) -> StoreError:
    """One line naming the object and what the store said, credentials removed."""
    text = redact(" ".join(str(exc).split()).split(" Debug source:")[0])  # obstore appends its debug dump
    if is_missing_bucket(exc):
        return BucketNotFound(url)
    if is_not_found(exc):
        return ObjectNotFound(f"{url}: no such object")
    return StoreError(f"{url}: the object store failed after its retries: {text[:400]}")


class RangeReader(io.RawIOBase):
    """obstore's buffered reader as the file object pyarrow takes (it has no `closed` or `readinto`); its errors
    become StoreError naming the object."""

    def __init__(self, reader: Any, url: str) -> None:
        super().__init__()
        self.reader, self.url = reader, url

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            data = self.reader.read(len(buffer))
        except Exception as exc:
            raise store_error(exc, self.url) from None
        buffer[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.reader.seek(offset, whence)

    def tell(self) -> int:
        return self.reader.tell()
