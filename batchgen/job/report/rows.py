"""What the job report needs of the output rows, gathered a table at a time (the final rewrite's tables, or a
finished output's parts): exact counts (finish reasons, error rows by reason, tokens) and, for the latency
distributions, a uniform sample of at most SAMPLE_ROWS rows (every row when there are fewer), so that memory does not
grow with the output."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..output.schema import error_mask

SAMPLE_ROWS = 100_000
LATENCIES = ("queue_s", "ttft_s", "tpot_s", "e2e_s")
COLUMNS = (*LATENCIES, "finish_reason", "error", "prompt_tokens", "output_tokens", "cached_tokens", "replica")
MAX_REASONS = 1000  # distinct error reasons counted; the rest are "other"
NUMBERS = re.compile(r"\d+(\.\d+)?")


def error_reason(message: str | None) -> str:
    """An error message with its numbers masked, so that rows failing for one reason count together."""
    return NUMBERS.sub("N", message or "(no message)")[:200]


class ReportRows:
    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.rows = 0
        self.finish_reasons: Counter[str] = Counter()
        self.error_reasons: Counter[str] = Counter()
        self.tokens = Counter()  # prompt, output, cached: sums over all rows
        self.sample: dict[str, np.ndarray] = {}
        self.keys = np.empty(0)  # the sampled rows' random keys: the SAMPLE_ROWS smallest are kept

    def add(self, table: pa.Table) -> None:
        names = [name for name in COLUMNS if name in table.column_names]
        table = table.select(names)
        self.rows += table.num_rows
        is_error = error_mask(table)
        if "finish_reason" in names:
            self.finish_reasons.update(dict(zip(*_value_counts(table["finish_reason"]))))
        else:  # a task other than generate: a row worked or failed
            errors_here = pc.sum(is_error).as_py() or 0
            self.finish_reasons.update({"ok": table.num_rows - errors_here, "error": errors_here})
            self.finish_reasons -= Counter()  # no zero counts
        errors = table.filter(is_error)["error"].to_pylist()
        for reason in map(error_reason, errors):
            if reason in self.error_reasons or len(self.error_reasons) < MAX_REASONS:
                self.error_reasons[reason] += 1
            else:
                self.error_reasons["other"] += 1
        for name in ("prompt_tokens", "output_tokens", "cached_tokens"):
            if name in names:  # output_tokens: generate's alone
                self.tokens[name] += pc.sum(table[name]).as_py() or 0
        keys = self.rng.random(table.num_rows)
        columns = {name: _numbers(table[name]) for name in (*LATENCIES, "output_tokens", "prompt_tokens", "replica")
                   if name in names}
        columns["ok"] = pc.invert(is_error).to_numpy(zero_copy_only=False)
        merged_keys = np.concatenate([self.keys, keys])
        merged = {name: np.concatenate([self.sample[name], values]) if name in self.sample else values
                  for name, values in columns.items()}
        if merged_keys.size > SAMPLE_ROWS:
            keep = np.argpartition(merged_keys, SAMPLE_ROWS)[:SAMPLE_ROWS]
            merged_keys, merged = merged_keys[keep], {name: values[keep] for name, values in merged.items()}
        self.keys, self.sample = merged_keys, merged

    @property
    def sampled(self) -> int:
        return int(self.keys.size)

    def values(self, name: str, replica: int | None = None) -> np.ndarray:
        """A latency of the sampled rows that have one (error rows and one-token rows lack some), seconds."""
        if name not in self.sample:
            return np.empty(0)
        values, keep = self.sample[name], self.sample["ok"]
        if replica is not None and "replica" in self.sample:
            keep = keep & (self.sample["replica"] == replica)
        values = values[keep]
        return values[~np.isnan(values)]

    def by_bins(self, name: str, by: str = "prompt_tokens", min_rows: int = 3) -> list[tuple[float, float, int]]:
        """(median `by`, median `name`, rows) of the sampled rows that have both, in power-of-two bins of `by`
        (1, 2-3, 4-7, ...); bins with fewer than `min_rows` rows are left out (a median of one row is noise)."""
        if name not in self.sample or by not in self.sample:
            return []
        values, keys = self.sample[name], self.sample[by]
        keep = self.sample["ok"] & ~np.isnan(values) & ~np.isnan(keys) & (keys >= 1)
        values, keys = values[keep], keys[keep]
        bins = np.floor(np.log2(keys)).astype(int) if keys.size else np.empty(0, dtype=int)
        out = []
        for b in np.unique(bins):
            inside = bins == b
            if inside.sum() >= min_rows:
                out.append((float(np.median(keys[inside])), float(np.median(values[inside])), int(inside.sum())))
        return out

    def replicas(self) -> list[int]:
        return sorted(int(r) for r in np.unique(self.sample["replica"])) if "replica" in self.sample else []

    def to_json(self) -> dict:
        """Percentiles and counts (no per-row data): what the side-by-side report compares."""
        out = {"rows": self.rows, "sampled": self.sampled, "finish_reasons": dict(self.finish_reasons),
               "error_reasons": dict(self.error_reasons.most_common(20)), "tokens": dict(self.tokens)}
        for name in LATENCIES:
            values = self.values(name)
            out[name] = {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)} if values.size else None
        return out


def _value_counts(column: pa.ChunkedArray) -> tuple[list, list]:
    counts = pc.value_counts(column)
    return counts.field("values").to_pylist(), counts.field("counts").to_pylist()


def _numbers(column: pa.ChunkedArray) -> np.ndarray:
    return column.cast(pa.float64()).fill_null(np.nan).to_numpy()
