"""glibc malloc settings for CPU steps: keep a step's freed memory for the next step instead of handing it back.

glibc serves an allocation above its mmap threshold (dynamic, 128 KiB rising to at most 32 MiB) with fresh pages from
the kernel and unmaps them on free, and trims the heap's free top above its trim threshold. A CPU step allocates and
frees the same large activations every layer and every step (an fp32 4,096-token prefill step of the default model:
30 gate_up outputs of 50 MB; a 256-row decode step: 50 MB of logits), so each one comes back as new pages, one page
fault per 4 KiB: 384k faults in that prefill step, ~10% of its time. Raising both thresholds above a step's
allocations lets the heap reuse them (the same step: 0 faults, 2.8 -> 2.4 s; docs/performance.md, "Change 10").
Allocations larger than the threshold (a KV cache, a big weight) are still mapped apart and returned when freed.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger("batchgen")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
# Tried in order: older glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB); 2.36 here takes 256 MiB.
MMAP_THRESHOLDS = (256 << 20, 32 << 20)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")


def keep_step_memory() -> int:
    """Raise glibc's mmap threshold (and the trim threshold to twice it) for this process. Returns the threshold
    set, or 0 where nothing was changed: not glibc, or the user set malloc's variables themselves."""
    mallopt = _mallopt()
    if mallopt is None:
        return 0
    for threshold in MMAP_THRESHOLDS:
        if mallopt(M_MMAP_THRESHOLD, threshold) == 1:
            mallopt(M_TRIM_THRESHOLD, 2 * threshold)
            logger.debug("malloc: mmap threshold %d MiB, trim threshold %d MiB", threshold >> 20, threshold >> 19)
            return threshold
    return 0


def return_freed_memory_at_once() -> int:
    """For a model's loading: a fixed, low mmap threshold (which also stops glibc raising it) and trim threshold,
    so that each freed copy (a weight read before its int8 or packed form, a quantization's temporaries) goes back
    to the kernel when freed instead of staying resident in the heap until the load ends: the peak RSS is then the
    weights plus one layer's copies. keep_step_memory() raises both again once the model is loaded. Returns the
    threshold set, or 0 where nothing was changed (as keep_step_memory)."""
    mallopt = _mallopt()
    if mallopt is None:
        return 0
    threshold = 128 << 10
    if mallopt(M_MMAP_THRESHOLD, threshold) == 1:
        mallopt(M_TRIM_THRESHOLD, threshold)
        return threshold
    return 0


def _mallopt():
    """glibc's mallopt, or None: not glibc, or the user set malloc's variables themselves."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_SETTINGS) \
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl, or no libc.so.6
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def release_freed_memory() -> bool:
    """malloc_trim(0): hand the heap's free pages back to the kernel (glibc's dynamic mmap threshold rises with each
    freed large block, so a model's loading leaves later mid-size copies in the heap, freed but resident)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return trim(0) == 1
