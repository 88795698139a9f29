"""Speculative decoding: a proposer guesses a decoding sequence's next few tokens, the target model computes them
all in one step beside the other rows, and the sampler keeps the guesses up to the first one it would not have drawn
itself (verify.py). Proposers: prompt lookup (ngram.py) and a small draft model (draft.py)."""
from .config import SPECULATIVE_METHODS, SpeculativeConfig
from .speculator import Speculator

__all__ = ["SPECULATIVE_METHODS", "SpeculativeConfig", "Speculator"]
