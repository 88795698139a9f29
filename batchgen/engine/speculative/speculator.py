"""Which decoding sequences guess this step, how many tokens each may guess, and the guesses themselves."""
from __future__ import annotations

from ..sequence import Sequence
from .config import SpeculativeConfig
from .ngram import propose_ngram


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None,
                 kernel_rows: int | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft  # draft.DraftProposer for method draft
        self.kernel_rows = kernel_rows  # models.quantization.weight_only_kernel_rows: a step's cost jumps past it

    @property
    def draft_bytes(self) -> int:
        """A draft model's weights and KV cache (in the engine's weights_bytes too)."""
        if self.draft is None:
            return 0
        from ...models.accounting import weight_bytes
        return weight_bytes(self.draft.model) + self.draft.kv_bytes

    def guesses(self, num_running: int) -> int:
        """The most tokens a sequence guesses in a step where `num_running` sequences decode: none above
        config.max_batch (the batch rule), and none where the guesses would take a step of at most a quarter of
        kernel_rows past it: that step is so cheap on the int8 kernel that the converted weight's cost outweighs
        what the guesses gain (the default model in bf16, 4 sequences: 0.52x the speed without guesses with 4
        each, 0.95x with 3 each, 16 rows; 8 sequences: 1.30x with 4, 1.02x with 1; docs/performance.md)."""
        if num_running > self.config.max_batch:
            return 0
        wanted = self.config.num_tokens
        if self.kernel_rows is not None and num_running * (1 + wanted) > self.kernel_rows >= 4 * num_running:
            return 0
        return wanted

    def lookahead(self, seq: Sequence) -> int:
        """How many guesses `seq` may verify this step: none unless it decodes, samples without a grammar or a
        penalty (their state follows each appended token), and has room for them before max_tokens and the
        context's end."""
        if not seq.samples or seq.matcher is not None or seq.penalty_state is not None:
            return 0
        if seq.num_computed_tokens + 1 != seq.num_tokens:
            return 0
        room = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.config.num_tokens, room))

    def propose(self, lookaheads: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Each sequence's guesses, at most its lookahead (fewer, or none, where the proposer has none)."""
        if self.draft is not None:
            return self.draft.propose(lookaheads)
        c = self.config
        return {seq: propose_ngram(seq.token_ids, k, c.min_match, c.max_match) for seq, k in lookaheads.items()}
