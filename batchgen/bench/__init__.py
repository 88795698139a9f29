"""`batchgen bench`: batchgen against transformers (static and continuous batching) and vLLM's CPU build, on the
same rows in the same run, greedy; JSON record, PNG chart and a performance archive."""
from .harness import BenchConfig, BenchResult, run_bench
from .report import format_table, history_table
from .systems import SYSTEMS

__all__ = ["SYSTEMS", "BenchConfig", "BenchResult", "format_table", "history_table", "run_bench"]
