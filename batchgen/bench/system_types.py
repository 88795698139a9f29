"""What every system under test takes besides the rows (BenchOptions) and gives back (SystemRun of RowOutputs).

Not named `types.py`: vllm_worker.py runs as a script from this folder, where such a file would shadow the
standard library's `types` for everything that worker imports."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16")  # --dtype and --hf-dtype; auto as the engine resolves it
# batchgen's engine quantization -> what runs, as the table says it: W8A8 = int8 weights and per-token int8
# activations; weight-only = int8 weights, activations in the model's dtype
QUANTIZATION_LABELS = {None: None, "int8": "int8 W8A8", "int8-weight-only": "int8 weight-only"}


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
class TaskRowOutput:
    """One row's answer in a prefill-only workload (task_workloads.py)."""

    id: int
    values: list[float]  # embed: the embedding; classify: each label's probability; score: each scored token's logprob
    label: str | None = None  # classify: the most probable label


@dataclass
class SystemRun:
    name: str
    available: bool
    reason: str | None = None  # why it is unavailable
    load_s: float | None = None  # model load (and start-up), apart from generation
    # A fresh process's start to ready for requests (interpreter, imports, weights, KV cache), where measured so
    startup_s: float | None = None
    wall_s: float | None = None  # generation of every row
    rows: list = field(default_factory=list)  # RowOutput, or TaskRowOutput in a prefill-only workload
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
    dtype: str = "float32"  # batchgen's (engine_args.dtype, resolved) and vLLM's
    hf_dtype: str = "float32"  # the transformers baselines'
    vllm_threads_bind: str = "all"  # vllm_system.threads_bind: all | default | a CPU list
    ignore_eos: bool = False  # fixed length: every row generates exactly its max_tokens


def elapsed(since: float) -> float:
    return time.monotonic() - since


def availability(run: SystemRun) -> dict[str, Any]:
    """The figures every system has, run or not (an unavailable one's details say why)."""
    figures: dict[str, Any] = {"available": run.available, "reason": run.reason, "dtype": run.details.get("dtype"),
                               "quantization": run.details.get("quantization")}
    if not run.available:
        figures["details"] = run.details
    return figures
