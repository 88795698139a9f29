"""What batchgen and its kernels both read of the machine: /proc/cpuinfo's lines and batchgen's cache directory.

The one definition of each. batchgen imports this package (batchgen/machine.py reads the CPU's flags and model
through `cpuinfo_line`, batchgen/models/gguf_cache.py its cache through `cache_root`); this package never imports
batchgen, so the two cannot meet anywhere higher. Nothing here imports torch."""
from __future__ import annotations

import os
from pathlib import Path

CPUINFO = "/proc/cpuinfo"


def cpuinfo_line(prefixes: tuple[str, ...], path: str = CPUINFO) -> str | None:
    """The value (after the colon) of the first line of /proc/cpuinfo that starts with one of `prefixes`, or None
    where there is no such line or no such file (macOS, a container without /proc)."""
    try:
        with open(path) as cpuinfo:
            for line in cpuinfo:
                if line.startswith(prefixes):
                    return line.partition(":")[2]
    except OSError:
        return None
    return None


def cache_root() -> Path:
    """batchgen's cache directory: BATCHGEN_CACHE_DIR, else ~/.cache/batchgen (converted models, built kernels, input
    copies). RuntimeError where there is no home to find it in."""
    return Path(os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen")
