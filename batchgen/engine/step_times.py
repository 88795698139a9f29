"""How long the engine's steps take, as a histogram: fixed buckets counted as steps finish (a bisect and two adds per
step), for the run's metrics (`batchgen run --metrics-port`) and its summary."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# upper bounds, seconds: a decode step of a small model on a GPU to a long prefill chunk on a CPU
STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class StepTimes:
    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_SECONDS_BUCKETS) + 1))  # the last: above all
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
        self.total_s += seconds

    def stats(self) -> dict:
        return {"step_seconds_buckets": list(STEP_SECONDS_BUCKETS), "step_seconds_counts": list(self.counts),
                "step_seconds_sum": self.total_s}
