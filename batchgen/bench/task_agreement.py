"""Whether a system's answers agree with batchgen's in a prefill-only workload, as greedy_check.py does for
generation: per row a measure of the difference, and a verdict against a rule fixed here (fp32 on both sides).

- embed: the cosine of the two embeddings, at least EMBED_MIN_COSINE on every row;
- classify: the largest difference of a label's probability at most CLASSIFY_MAX_PROB_DIFF on every row, and the
  same label wherever the two most probable labels are further apart than that;
- score: the relative difference of the summed log-likelihoods (|ours - theirs| / |theirs|) at most
  SCORE_MAX_REL_DIFF on every row, on the same number of scored tokens."""
from __future__ import annotations

import math

EMBED_MIN_COSINE = 0.9999
CLASSIFY_MAX_PROB_DIFF = 1e-4
SCORE_MAX_REL_DIFF = 1e-4


def cosine(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("nan")
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else float("nan")


def relative_difference(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / max(abs(theirs), 1e-12)


def verdict(task: str, reference: dict, other: dict) -> dict:
    """reference, other: {row id: TaskRowOutput}. The rows both answered are compared; a row one of them lacks
    fails the check."""
    ids = sorted(reference.keys() & other.keys())
    missing = len(reference.keys() ^ other.keys())
    if task == "embed":
        per_row = {i: cosine(reference[i].values, other[i].values) for i in ids}
        worst = min(per_row.values(), default=float("nan"))
        ok = all(value >= EMBED_MIN_COSINE for value in per_row.values())  # a NaN (other length) fails
        result = {"measure": "cosine", "min_cosine": worst, "rule": f"cosine >= {EMBED_MIN_COSINE} on every row"}
    elif task == "classify":
        per_row, labels_differ = {}, 0
        for i in ids:
            ours, theirs = reference[i], other[i]
            if len(ours.values) != len(theirs.values):
                per_row[i] = float("inf")
                continue
            per_row[i] = max((abs(x - y) for x, y in zip(ours.values, theirs.values)), default=0.0)
            top = sorted(ours.values, reverse=True)
            clear = len(top) < 2 or top[0] - top[1] > CLASSIFY_MAX_PROB_DIFF
            labels_differ += clear and ours.label != theirs.label
        worst = max(per_row.values(), default=float("nan"))
        ok = labels_differ == 0 and all(value <= CLASSIFY_MAX_PROB_DIFF for value in per_row.values())
        same = sum(1 for i in ids if reference[i].label == other[i].label)
        result = {"measure": "max |probability difference|", "max_prob_diff": worst,
                  "same_label_share": same / len(ids) if ids else None, "labels_differ_where_clear": labels_differ,
                  "rule": f"max |p - p'| <= {CLASSIFY_MAX_PROB_DIFF} and the same label where it is clear"}
    else:
        per_row, lengths_differ = {}, 0
        for i in ids:
            ours, theirs = reference[i].values, other[i].values
            lengths_differ += len(ours) != len(theirs)
            per_row[i] = relative_difference(sum(ours), sum(theirs)) if len(ours) == len(theirs) else float("inf")
        worst = max(per_row.values(), default=float("nan"))
        ok = lengths_differ == 0 and all(value <= SCORE_MAX_REL_DIFF for value in per_row.values())
        token_diffs = [max((abs(x - y) for x, y in zip(reference[i].values, other[i].values)), default=0.0)
                       for i in ids]
        result = {"measure": "relative difference of the log-likelihood", "max_rel_diff": worst,
                  "max_token_logprob_diff": max(token_diffs, default=None),
                  "scored_token_counts_differ": lengths_differ,
                  "rule": f"|sum - sum'| / |sum'| <= {SCORE_MAX_REL_DIFF} on every row"}
    ok = ok and missing == 0 and bool(ids)
    return {"ok": ok, "rows": len(ids), "rows_missing": missing, **result,
            "per_row": {str(i): value for i, value in per_row.items()}}
