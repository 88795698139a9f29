"""Which guessed tokens stand. Each guess's row is sampled exactly as a plain decode at that position would be (its
request's seed and output position: sampler.py), and a guess stands while it equals that draw. So the output is the
one a run without speculation makes, greedy or seeded, token for token: the guesses only decide how many of those
draws one step makes. For a guess from a deterministic proposer (prompt lookup, a greedy draft model) this is
the rejection rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a guess g stands with
probability p(g), and where it falls, the token drawn is distributed as p without g."""
from __future__ import annotations

from ..sequence import Sequence


def confirmed_rows(seqs: list[Sequence], offsets: list[int], tokens: list[int]) -> list[int]:
    """The rows whose tokens a step appends. Rows come in runs of one sequence: offset 0 (after its last token),
    then one row per guess. A run keeps its rows up to the first whose draw differs from the guess it was computed
    with, that draw included: the guesses before it stood, and it is the step's own token."""
    kept = []
    for row, (seq, offset) in enumerate(zip(seqs, offsets)):
        if offset == 0 or (kept and kept[-1] == row - 1 and tokens[row - 1] == seq.draft_token_ids[offset - 1]):
            kept.append(row)
    return kept
