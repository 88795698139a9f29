"""Turns one scheduled step into a flat varlen batch, runs the model over the paged KV cache, samples."""
from __future__ import annotations

import numpy as np
import torch

from batchgen_kernels import AttentionMetadata

from .cuda_graphs import DecodeGraphRunner
from .sampler import Sampler, SamplingBatch
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, eos_token_ids: list[int]) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.decode_graphs: DecodeGraphRunner | None = None  # set by the engine on CUDA: decode-only steps
        # One allocation for every layer's K and V. Zeroed, not empty: attention reads whole blocks and masks the
        # positions past a sequence's end, and a masked NaN from uninitialised memory would still poison 0 * v.
        self.kv_cache = torch.zeros((model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim),
                                    dtype=dtype, device=device)
        model.bind_kv_cache([self.kv_cache[i, 0] for i in range(model.num_layers)],
                            [self.kv_cache[i, 1] for i in range(model.num_layers)])

    def _prepare(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        query_lens = [n for _, n in batch]
        seq_lens = [seq.num_computed_tokens + n for seq, n in batch]
        max_blocks = -(-max(seq_lens) // bs)
        block_tables = np.zeros((len(batch), max_blocks), dtype=np.int32)
        input_ids: list[int] = []
        positions = np.empty(sum(query_lens), dtype=np.int64)
        slot_mapping = np.empty_like(positions)
        offset = 0
        for row, (seq, n) in enumerate(batch):
            start = seq.num_computed_tokens
            ids = [block.block_id for block in seq.blocks]
            block_tables[row, : len(ids)] = ids
            input_ids.extend(seq.token_ids[start:start + n])
            pos = np.arange(start, start + n)
            positions[offset:offset + n] = pos
            slot_mapping[offset:offset + n] = block_tables[row, pos // bs].astype(np.int64) * bs + pos % bs
            offset += n
        query_start_loc = np.zeros(len(batch) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        to = lambda array: torch.from_numpy(array).to(self.device, non_blocking=True)  # noqa: E731
        metadata = AttentionMetadata(
            query_start_loc=to(query_start_loc), seq_lens=to(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=to(block_tables), slot_mapping=to(slot_mapping), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), num_decodes=sum(1 for n in query_lens if n == 1),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), to(positions), metadata

    @torch.inference_mode()
    def execute(self, scheduled: dict[Sequence, int]) -> tuple[list[Sequence], list[int]]:
        """Run one step. Returns the sequences that reached their last token this step and the token each sampled."""
        # Decodes (one new token) first: the attention backends batch them together.
        batch = sorted(scheduled.items(), key=lambda item: item[1] != 1)
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            hidden = self.decode_graphs.run(batch)
        else:
            input_ids, positions, metadata = self._prepare(batch)
            hidden = self.model(input_ids, positions, metadata)

        rows, samplers = [], []
        end = 0
        for seq, n in batch:
            end += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(end - 1)
                samplers.append(seq)
        if not samplers:
            return [], []
        if len(rows) < hidden.shape[0]:  # else every row samples (a decode-only step): no gather, no copy
            hidden = hidden[torch.tensor(rows).to(self.device, non_blocking=True)]
        logits = self.model.compute_logits(hidden)
        sampling = SamplingBatch.build(
            [seq.params for seq in samplers], [seq.seed for seq in samplers],
            _LazyTokens(samplers, prompt=True), _LazyTokens(samplers, prompt=False),
            self.eos_token_ids, logits.shape[-1], self.device)
        return samplers, self.sampler(logits, sampling).tolist()


class _LazyTokens:
    """Per-row prompt or output token lists, sliced only for the rows the sampler reads (penalties, min_tokens):
    the greedy path never copies a sequence's tokens."""

    def __init__(self, seqs: list[Sequence], prompt: bool) -> None:
        self.seqs, self.prompt = seqs, prompt

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, row: int) -> list[int]:
        seq = self.seqs[row]
        return seq.token_ids[: seq.num_prompt_tokens] if self.prompt else seq.output_token_ids
