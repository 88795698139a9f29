"""How long the engine's steps take, as a histogram (fixed buckets counted as steps finish: a bisect and a few adds per
step), and how big they were, as running sums: for the run's metrics (`batchgen run --metrics-port`), its summary
and its timeline (the batch size over an interval is the growth of `step_seqs_sum` over that of the step count)."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# upper bounds, seconds: a decode step of a small model on a GPU to a long prefill chunk on a CPU
STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class StepTimes:
    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_SECONDS_BUCKETS) + 1))  # the last: above all
    total_s: float = 0.0
    seqs_total: int = 0  # sequences scheduled, summed over steps
    tokens_total: int = 0  # tokens computed (prompt, recomputed and decoded), summed over steps

    def observe(self, seconds: float, num_seqs: int = 0, num_tokens: int = 0) -> None:
        self.counts[bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
        self.total_s += seconds
        self.seqs_total += num_seqs
        self.tokens_total += num_tokens

    def stats(self) -> dict:
        return {"step_seconds_buckets": list(STEP_SECONDS_BUCKETS), "step_seconds_counts": list(self.counts),
                "step_seconds_sum": self.total_s, "step_seqs_sum": self.seqs_total,
                "step_tokens_sum": self.tokens_total}
