"""`batchgen bench --workload speculative` (spec_bench.py) end to end on a few rows of the default model: both
modes at each batch, greedy outputs equal with and without speculation, acceptance reported. No timings checked."""
from __future__ import annotations

import json

import pytest

from batchgen.bench.spec_bench import SpecBenchConfig, format_spec_table, run_spec_bench


def _bench(tmp_path, **config):
    settings = dict(dtype="float32", rows=4, batch_sizes=(1, 4), max_tokens=16, kv_cache_memory="64MiB",
                    out_dir=str(tmp_path), archive=str(tmp_path / "archive.jsonl"))
    return run_spec_bench(SpecBenchConfig(**{**settings, **config}), log=lambda line: None)


def test_both_modes_agree_and_report_acceptance(tmp_path):
    result = _bench(tmp_path, batch_invariant=True, rows=2, batch_sizes=(1, 2))
    record = result.record
    assert set(record["systems"]) == {f"{w}/b{b}/{m}" for w in ("extraction", "generation") for b in (1, 2)
                                      for m in ("off", "on")}
    for name, entry in record["comparisons"].items():
        assert entry["identical_share"] == 1.0, (name, entry)
    extraction = record["systems"]["extraction/b1/on"]
    assert extraction["spec_draft_tokens"] > 0 and extraction["spec_acceptance_rate"] is not None
    assert record["systems"]["extraction/b1/off"]["spec_draft_tokens"] == 0
    assert record["cpu_flags"] is not None and "load_avg" in record
    table = format_spec_table(record)
    assert "extraction" in table and "generation" in table and "on/off" in table
    archived = json.loads((tmp_path / "archive.jsonl").read_text().splitlines()[-1])
    assert archived["kind"] == "speculative" and "rows" not in archived
    assert json.loads(result.record_path.read_text())["rows"]["extraction/b2/on"]


def test_default_kernels_agree(tmp_path):
    """The default kernels (not batch-invariant), fp32: a guess's row is a decode row of the decode kernel, as it
    would be one step at a time, so greedy outputs are the same (the prefill kernels' bf16 tiles moved them by up
    to 1.2 logits when the guesses went through them)."""
    record = _bench(tmp_path, rows=4, workloads=("extraction",), batch_sizes=(1,)).record
    assert record["comparisons"]["extraction/b1/on"]["identical_share"] == 1.0
