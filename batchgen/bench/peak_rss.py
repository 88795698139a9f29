"""PeakRSS: the highest resident memory of a process (or of its whole process tree) while a system runs."""
from __future__ import annotations

import threading
from typing import Any

import psutil


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
