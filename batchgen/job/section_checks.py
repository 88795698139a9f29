"""Checks of the executor: and storage: sections' values, beyond their YAML types (config.py runs them). The sections
themselves are leaves below both: executor_config.py and batchgen/object_store.py (StorageConfig)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .keys import JobConfigError

if TYPE_CHECKING:
    from batchgen.object_store import StorageConfig

    from .executor_config import ExecutorConfig


def check_executor(cfg: ExecutorConfig) -> None:
    if cfg.replicas < 1:
        raise JobConfigError("executor.replicas: must be at least 1")
    if cfg.cpus_per_replica < 1:
        raise JobConfigError("executor.cpus_per_replica: must be at least 1")
    if cfg.gpus_per_replica < 0:
        raise JobConfigError("executor.gpus_per_replica: must not be negative")
    if cfg.batch_size is not None and cfg.batch_size < 1:
        raise JobConfigError("executor.batch_size: must be at least 1")
    if cfg.address is not None and not cfg.address.strip():
        raise JobConfigError("executor.address: must not be empty (leave it out for RAY_ADDRESS or a local Ray)")


def check_storage(cfg: StorageConfig) -> None:
    if cfg.endpoint_url is not None and not cfg.endpoint_url.startswith(("http://", "https://")):
        raise JobConfigError(f"storage.endpoint_url: {cfg.endpoint_url!r} must start with http:// or https://")
    if cfg.max_retries < 0:
        raise JobConfigError("storage.max_retries: must not be negative")
    if not cfg.timeout_s > 0:
        raise JobConfigError("storage.timeout_s: must be positive")
    if not cfg.lease_ttl_s > 0:
        raise JobConfigError("storage.lease_ttl_s: must be positive")
