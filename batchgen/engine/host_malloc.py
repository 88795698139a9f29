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
import threading

logger = logging.getLogger("batchgen")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters (malloc.h)
DEFAULT_MMAP_MAX, LARGEST_TRIM_THRESHOLD = 65536, 2**31 - 1
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


class PrefaultedHeap:
    """For a model's loading: `nbytes` of heap (about the weights to come) faulted in by a background thread while
    the main thread loads the tokenizer and the config, which is pure Python (the GIL held, one core busy). Every
    tensor the loader makes is a fresh allocation whose first touch costs ~0.65 s per GiB here (a 1B fp32 model's
    packed weights: ~2.5 s); carved from memory already touched, it costs nothing more.

    While it lives, nothing is served by mmap (M_MMAP_MAX 0: the loader's allocations come from the heap the thread
    touched) and the heap is not trimmed. The region is made of 64 MiB pieces; hand_over() frees all but the highest,
    which keeps the freed pieces off the heap's top (glibc trims a top above its trim threshold, an int: at most
    2 GiB) until close() frees it and restores mmap; release_freed_memory() then hands back what the model did
    not take."""

    PIECE = 64 << 20

    def __init__(self, nbytes: int) -> None:
        self._libc = _libc_malloc()
        self._pieces: list[int] = []
        self._thread: threading.Thread | None = None
        if self._libc is None or nbytes < self.PIECE:
            return
        self._libc.mallopt(M_MMAP_MAX, 0)
        self._libc.mallopt(M_TRIM_THRESHOLD, LARGEST_TRIM_THRESHOLD)
        for _ in range(nbytes // self.PIECE + 2):  # room for the allocations' headers, and the highest piece
            piece = self._libc.malloc(self.PIECE)
            if not piece:  # the heap cannot grow this far (brk runs into a mapping): keep what was had
                break
            self._pieces.append(piece)
        self._thread = threading.Thread(target=self._touch, args=(list(self._pieces),), daemon=True)
        self._thread.start()

    @property
    def reserved(self) -> bool:
        """Whether it holds a region (not glibc, a user's malloc settings, or a small model: it does not)."""
        return bool(self._pieces)

    def _touch(self, pieces: list[int]) -> None:
        for piece in pieces:
            ctypes.memset(piece, 0, self.PIECE)  # ctypes drops the GIL for the call

    def hand_over(self) -> None:
        """Before the weights are read: wait for the faulting, then free the pieces for the loader to reuse."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        while len(self._pieces) > 1:
            self._libc.free(self._pieces.pop(0))

    def close(self) -> None:
        self.hand_over()
        if self._libc is None:
            return
        for piece in self._pieces:
            self._libc.free(piece)
        self._pieces = []
        self._libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)


def _libc_malloc():
    """libc with malloc, free and mallopt typed, or None (as _mallopt)."""
    if _mallopt() is None:
        return None
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.argtypes, libc.malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = (ctypes.c_void_p,), None
    libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return libc
