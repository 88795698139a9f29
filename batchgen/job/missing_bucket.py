"""A bucket that does not exist is a problem with the job, not a store that failed: the key that names it, exit 2
(a store that failed is a runtime failure, exit 1, that a re-run resumes from)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from batchgen.object_store import BucketNotFound

from .keys import JobConfigError


@contextmanager
def bucket_must_exist(key: str, url: str) -> Iterator[None]:
    """BucketNotFound inside as JobConfigError naming `key` (input.path, output.path, model), its value `url` and
    the bucket."""
    try:
        yield
    except BucketNotFound as exc:
        raise JobConfigError(f"{key}: {url}: the bucket {exc.bucket} does not exist") from None
