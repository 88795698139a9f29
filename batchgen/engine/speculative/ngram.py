"""Prompt lookup (Saxena 2023; vLLM's and SGLang's `ngram`): find the context's last n tokens earlier in the
context and guess that what followed them then follows them now. Free to compute, and right for spans that the
output copies from the prompt (extraction, rewriting, quoting)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], num_tokens: int, min_match: int, max_match: int) -> list[int]:
    """Up to `num_tokens` tokens following the latest earlier occurrence of the longest suffix n-gram
    (min_match <= n <= max_match) of `token_ids`; [] where none occurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_match, length - 1), min_match - 1, -1):
        # Windows starting at 0 .. length - n - 1: every occurrence but the suffix itself.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + num_tokens].tolist()
    return []
