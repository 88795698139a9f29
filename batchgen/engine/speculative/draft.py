"""A small draft model that shares the target's tokenizer guesses each speculating sequence's next tokens, greedily.

Its KV cache mirrors the target's global pool block for block: the same number of blocks of the same size, read
through the target's block tables and slot mapping, so it needs no block bookkeeping of its own; the pool has
already given a sequence the slots of this step's guesses when the draft runs. A sequence's `num_draft_computed`
says how many of its tokens the draft's cache holds. The draft catches up from there to the sequence's last token
in one pass (after a prefill, a preemption or steps that did not speculate: the whole context, as a prefill) and
makes its first guess; each further pass feeds a guess back and makes the next. Guesses that fall leave draft KV
past the sequence's confirmed tokens, which the next catch-up writes over."""
from __future__ import annotations

import numpy as np
import torch

from batchgen_kernels import AttentionMetadata

from ..errors import SettingError
from ..sequence import Sequence


class DraftProposer:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, attention_backend: str, vocab_size: int) -> None:
        from ..model_runner import GroupCache

        self.model, self.block_size, self.device = model, block_size, device
        self.vocab_size = vocab_size  # the target's: a guess past it is dropped
        self.cache = GroupCache(model, model.num_layers, num_blocks, block_size, dtype, device)
        model.bind_kv_cache([layer[0] for layer in self.cache.tensor], [layer[1] for layer in self.cache.tensor],
                            attention_backend)

    @property
    def kv_bytes(self) -> int:
        return self.cache.tensor.numel() * self.cache.tensor.element_size()

    @torch.inference_mode()
    def propose(self, lookaheads: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Up to `lookaheads[seq]` greedy guesses for each sequence, after its last token."""
        seqs = list(lookaheads)
        starts = [min(seq.num_draft_computed, seq.num_computed_tokens) for seq in seqs]
        inputs = [seq.token_ids[start:] for seq, start in zip(seqs, starts)]
        guesses: dict[Sequence, list[int]] = {seq: [] for seq in seqs}
        live = list(range(len(seqs)))  # rows still guessing
        for step in range(max(lookaheads.values())):
            tokens = self._forward([seqs[i] for i in live], [starts[i] for i in live], [inputs[i] for i in live])
            still = []
            for i, token in zip(live, tokens):
                seq = seqs[i]
                seq.num_draft_computed = starts[i] + len(inputs[i])
                if token >= self.vocab_size:
                    continue
                guesses[seq].append(token)
                if len(guesses[seq]) < lookaheads[seq]:
                    starts[i], inputs[i] = starts[i] + len(inputs[i]), [token]
                    still.append(i)
            live = still
            if not live:
                break
        return guesses

    def _forward(self, seqs: list[Sequence], starts: list[int], inputs: list[list[int]]) -> list[int]:
        """One pass: row i computes inputs[i] at positions starts[i].. of seqs[i]; the greedy next token of each."""
        order = sorted(range(len(seqs)), key=lambda i: len(inputs[i]) != 1)  # the kernels take decodes first
        bs = self.block_size
        query_lens = [len(inputs[i]) for i in order]
        seq_lens = [starts[i] + len(inputs[i]) for i in order]
        width = -(-max(seq_lens) // bs)
        tables = np.zeros((len(order), width), dtype=np.int32)
        positions = np.concatenate([np.arange(starts[i], starts[i] + len(inputs[i])) for i in order])
        slots = np.empty_like(positions)
        offset = 0
        for row, i in enumerate(order):
            ids = seqs[i].block_ids.array[: -(-seq_lens[row] // bs)]
            tables[row, : len(ids)] = ids
            pos = positions[offset:offset + query_lens[row]]
            slots[offset:offset + query_lens[row]] = ids[pos // bs].astype(np.int64) * bs + pos % bs
            offset += query_lens[row]
        self.cache.zero_below(int(tables.max()) + 1)
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, slots, self.device)
        input_ids = torch.tensor([t for i in order for t in inputs[i]], dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(self.device), metadata)
        last = torch.tensor(np.cumsum(query_lens) - 1, device=self.device)
        tokens = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        by_row = [0] * len(seqs)
        for row, i in enumerate(order):
            by_row[i] = tokens[row]
        return by_row


def check_draft(model: torch.nn.Module, draft_tokenizer, target_tokenizer, name: str) -> None:
    """A draft must speak the target's tokens and attend over the whole context (its cache has no local pool)."""
    if any(window is not None for window in model.sliding_windows()):
        raise SettingError("speculative.model", f"speculative.model {name}: a model with sliding-window layers "
                                                f"cannot draft (its cache mirrors the target's global pool)")
    if draft_tokenizer is None or target_tokenizer is None or \
            draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise SettingError("speculative.model", f"speculative.model {name} does not share the model's tokenizer: "
                                                f"its guesses would be other tokens")


def load_draft(args, num_blocks: int, dtype: torch.dtype, device: torch.device, pack: bool, target_tokenizer,
               vocab_size: int) -> DraftProposer:
    """EngineArgs.speculative's draft model, loaded as the target is (its dtype, device and packing, no
    quantization), with a cache of `num_blocks` blocks (the target's global pool's)."""
    from ...models.loader import engine_model_dir, load_model, load_tokenizer
    from ...models.registry import ModelError

    name = args.speculative.model
    try:
        model_dir = engine_model_dir(name, "generate")
        model = load_model(model_dir, dtype, device, None, pack, "auto")
    except (ModelError, OSError, ValueError) as exc:
        raise SettingError("speculative.model", f"speculative.model {name}: {exc}") from None
    check_draft(model, load_tokenizer(model_dir), target_tokenizer, name)
    return DraftProposer(model, num_blocks, args.block_size, dtype, device, args.attention_backend, vocab_size)
