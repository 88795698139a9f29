"""The systems under test by name, and running one of them: a system that cannot run comes back unavailable, with
the reason; it never stops the bench."""
from __future__ import annotations

import gc
import traceback
from typing import Callable

from . import batchgen_system, hf_continuous, hf_static, task_baselines, task_batchgen, vllm_score, vllm_system
from .workloads import LABELING_LABELS
from .peak_rss import PeakRSS
from .system_types import BenchOptions, SystemRun

RUNNERS: dict[str, Callable[[list, BenchOptions], SystemRun]] = {
    "batchgen": lambda rows, options: batchgen_system.run(rows, options, prefix_caching=True, startup_probe=True),
    "batchgen-nocache": lambda rows, options: batchgen_system.run(rows, options, prefix_caching=False),
    "batchgen-choice": lambda rows, options: batchgen_system.run(rows, options, prefix_caching=True,
                                                                 choice=LABELING_LABELS),
    "batchgen-invariant": lambda rows, options: batchgen_system.run(rows, options, prefix_caching=True,
                                                                    batch_invariant=True),
    "hf-static": hf_static.run,
    "hf-continuous": hf_continuous.run,
    "vllm": vllm_system.run,
}
SYSTEMS = tuple(RUNNERS)
# The prefill-only workloads' systems (task_harness.py), by task, batchgen first (the reference)
TASK_SYSTEMS: dict[str, dict[str, Callable[[list, BenchOptions], SystemRun]]] = {
    "embed": {"batchgen": task_batchgen.run, "sentence-transformers": task_baselines.sentence_transformers},
    "classify": {"batchgen": task_batchgen.run, "hf-pipeline": task_baselines.text_classification},
    "score": {"batchgen": task_batchgen.run, "vllm": vllm_score.run, "hf-forward": task_baselines.causal_lm_forward},
}


def run_system(name: str, rows: list, options: BenchOptions,
               runners: dict[str, Callable[[list, BenchOptions], SystemRun]] = RUNNERS) -> SystemRun:
    """Run one system over `rows`, watching this process's memory (unless the system reports its own, as the
    vLLM worker does); any failure becomes an unavailable SystemRun."""
    runner = runners[name]
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
