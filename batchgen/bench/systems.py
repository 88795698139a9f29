"""What every system under test returns (SystemRun), how its memory is watched (PeakRSS), and which function runs
each system by name. A system that cannot run comes back unavailable, with the reason; it never stops the bench."""
from __future__ import annotations

import gc
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil

SYSTEMS = ("batchgen", "batchgen-nocache", "hf-static", "hf-continuous", "vllm")


@dataclass
class RowOutput:
    """One row's greedy output. Times are seconds since the start of the system's generation run (every row of an
    offline batch arrives at that moment), None where the system does not expose them."""

    id: int
    token_ids: list[int]  # including the EOS token when the row stopped on it
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.first_token_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.finish_s is None or len(self.token_ids) < 2:
            return None
        return (self.finish_s - self.first_token_s) / (len(self.token_ids) - 1)


@dataclass
class SystemRun:
    name: str
    available: bool
    reason: str | None = None  # why it is unavailable
    load_s: float | None = None  # model load (and start-up), apart from generation
    wall_s: float | None = None  # generation of every row
    rows: list[RowOutput] = field(default_factory=list)
    peak_rss_bytes: int | None = None
    details: dict[str, Any] = field(default_factory=dict)  # system-specific figures (batch size, cache hits, ...)

    @classmethod
    def unavailable(cls, name: str, reason: str, **details: Any) -> "SystemRun":
        return cls(name, False, reason, details=details)


@dataclass
class BenchOptions:
    """What the systems need besides the rows."""

    engine_args: Any  # batchgen.engine.EngineArgs for the batchgen systems (the model too)
    hf_batch_sizes: tuple[int, ...] = (16, 32)
    vllm_python: str | None = None
    hf_continuous_time_limit_s: float = 1800.0


class PeakRSS:
    """Samples the resident memory of a process (with `children`, of its whole process tree) every 50 ms in a
    thread; `peak` is the highest. Use as a context manager around a system's whole run. Sampling is kept cheap
    (no walk over /proc unless asked for): it shares the GIL with the system being measured."""

    def __init__(self, pid: int | None = None, children: bool = False, interval_s: float = 0.05):
        self.process = psutil.Process(pid)
        self.children = children
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def rss(self) -> int:
        total = 0
        try:
            processes = [self.process] + (self.process.children(recursive=True) if self.children else [])
        except psutil.Error:
            return 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.Error:
                pass  # a child that just exited
        return total

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRSS":
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def system_runners() -> dict[str, Callable]:
    from . import batchgen_system, hf_continuous, hf_static, vllm_system

    return {
        "batchgen": lambda rows, options: batchgen_system.run(rows, options, prefix_caching=True),
        "batchgen-nocache": lambda rows, options: batchgen_system.run(rows, options, prefix_caching=False),
        "hf-static": hf_static.run,
        "hf-continuous": hf_continuous.run,
        "vllm": vllm_system.run,
    }


def run_system(name: str, rows: list, options: BenchOptions) -> SystemRun:
    """Run one system over `rows`, watching this process's memory (unless the system reports its own, as the
    vLLM worker does); any failure becomes an unavailable SystemRun."""
    runner = system_runners()[name]
    try:
        with PeakRSS() as rss:
            run = runner(rows, options)
        if run.peak_rss_bytes is None:
            run.peak_rss_bytes = rss.peak
        return run
    except Exception as exc:
        return SystemRun.unavailable(name, f"failed: {type(exc).__name__}: {exc}",
                                     traceback=traceback.format_exc(limit=8))
    finally:
        gc.collect()  # let the system's model go before the next one loads


def elapsed(since: float) -> float:
    return time.monotonic() - since
