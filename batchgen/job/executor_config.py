"""The job file's `executor:` section as a dataclass: a leaf that config.py (the job) and section_checks.py (its
values' checks) both import, as StorageConfig, the `storage:` section, lives in batchgen/object_store.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ExecutorConfig:
    """Where the engine runs: `local` (this process) or `ray` (engine replicas on a Ray cluster, fed by Ray Data;
    job/executors/ray.py). Results do not depend on it."""

    kind: Literal["local", "ray"] = "local"
    address: str | None = None  # the Ray cluster; default: RAY_ADDRESS, else a local Ray started for the run
    replicas: int = 1  # engine replicas (one per GPU on a GPU cluster)
    gpus_per_replica: float = 1.0  # on a cluster with GPUs; ignored where the engine runs on CPUs
    cpus_per_replica: int = 1  # CPU threads per replica (torch threads when it runs on CPUs)
    batch_size: int | None = None  # rows per batch sent to a replica; default: input.sort_window (one sorted window)
