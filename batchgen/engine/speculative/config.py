"""`engine.speculative`: which proposer, how many tokens it guesses, and up to which batch it runs."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SettingError

SPECULATIVE_METHODS = ("ngram", "draft")

# Speculation runs in a step only while at most this many sequences decode. Verifying K guesses costs a row of
# matmul work each; where a step's matmuls are already compute-bound (a CPU at a few dozen rows), rejected guesses
# are pure loss. Measured (docs/performance.md, "Issue 43: speculative decoding"; 135M bf16, 2 AMX cores): copying
# rows 1.19x at 32 sequences, 1.05x at 64 and 1.02x at 128 (step cost 1.6-1.8x, inside one run's noise); free text
# 1.02x at 32. So 32: the largest batch where copying rows still clearly gain and free text does not lose.
DEFAULT_MAX_BATCH = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # ngram (prompt lookup: the continuation of the latest earlier occurrence of the context's last
    # n-gram) | draft (a small model with the target's tokenizer proposes, greedily)
    num_tokens: int = 4  # tokens guessed per step and sequence
    min_match: int = 2  # ngram: the shortest suffix n-gram looked up
    max_match: int = 4  # ngram: the longest (the longest that occurs wins)
    model: str | None = None  # draft: the draft model (a directory, a GGUF, a hub id: as `model`)
    max_batch: int = DEFAULT_MAX_BATCH  # speculate only in steps where at most this many sequences decode

    def validate(self) -> None:
        key = "speculative"
        if self.method not in SPECULATIVE_METHODS:
            raise SettingError(f"{key}.method", f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                                                f"got {self.method!r}")
        for name in ("num_tokens", "min_match", "max_match", "max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SettingError(f"{key}.{name}", f"speculative.{name} must be a positive integer, got {value!r}")
        if self.num_tokens > 16:
            raise SettingError(f"{key}.num_tokens", f"speculative.num_tokens must be at most 16, got {self.num_tokens}")
        if self.max_match < self.min_match:
            raise SettingError(f"{key}.max_match", f"speculative.max_match ({self.max_match}) is below min_match "
                                                   f"({self.min_match})")
        if self.method == "draft" and not (isinstance(self.model, str) and self.model):
            raise SettingError(f"{key}.model", "speculative.method draft needs speculative.model: the draft model")
        if self.method == "ngram" and self.model is not None:
            raise SettingError(f"{key}.model", "speculative.model is the draft model of method draft; method ngram "
                                               "looks up the sequence's own tokens")

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """A SpeculativeConfig from the Python API's plain dict too."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise SettingError("speculative", f"speculative must be a mapping such as {{method: ngram}}, got {value!r}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown or "method" not in value:
            raise SettingError("speculative", f"speculative: unknown key {unknown[0]!r}" if unknown
                               else "speculative needs a method (ngram or draft)")
        return cls(**value)
