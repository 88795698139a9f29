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
                 device: torch.device, eos_token_ids: list[int], attention_backend: str = "auto") -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.decode_graphs: DecodeGraphRunner | None = None  # set at startup on CUDA: decode-only steps
        # One allocation for every layer's K and V. The torch attention reads whole blocks and masks the positions
        # past a sequence's end, and a masked NaN from uninitialised memory would still poison 0 * v, so a block is
        # zeroed before its first use (zero_blocks_below); stale K/V of an earlier sequence is finite, hence safe.
        # On the CPU the cache is left unwritten until then, so its pages become resident only as blocks are used.
        shape = (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        on_cpu = device.type == "cpu"
        self.kv_cache = (torch.empty if on_cpu else torch.zeros)(shape, dtype=dtype, device=device)
        self.num_zeroed_blocks = 0 if on_cpu else num_blocks  # blocks [0, this) hold finite values
        model.bind_kv_cache([self.kv_cache[i, 0] for i in range(model.num_layers)],
                            [self.kv_cache[i, 1] for i in range(model.num_layers)], attention_backend)

    def zero_blocks_below(self, num_blocks: int) -> None:
        """Zero blocks [num_zeroed_blocks, num_blocks) of every layer: the blocks the pool handed out for the first
        time (it hands out never-used blocks in id order)."""
        if num_blocks > self.num_zeroed_blocks:
            self.kv_cache[:, :, self.num_zeroed_blocks:num_blocks].zero_()
            self.num_zeroed_blocks = num_blocks

    def _prepare(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        query_lens = [n for _, n in batch]
        seq_lens = [seq.num_computed_tokens + n for seq, n in batch]
        block_tables = np.zeros((len(batch), -(-max(seq_lens) // bs)), dtype=np.int32)
        input_ids: list[int] = []
        positions = np.empty(sum(query_lens), dtype=np.int64)
        slot_mapping = np.empty_like(positions)
        offset = 0
        for row, (seq, n) in enumerate(batch):
            start = seq.num_computed_tokens
            ids = seq.block_ids.array
            block_tables[row, : len(ids)] = ids
            input_ids.extend(seq.token_ids[start:start + n])
            pos = np.arange(start, start + n)
            positions[offset:offset + n] = pos
            slot_mapping[offset:offset + n] = ids[pos // bs].astype(np.int64) * bs + pos % bs
            offset += n
        metadata = AttentionMetadata.build(query_lens, seq_lens, block_tables, slot_mapping, self.device)
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.from_numpy(positions).to(self.device, non_blocking=True), metadata)

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

        rows, sampling_seqs = [], []
        end = 0
        for seq, n in batch:
            end += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(end - 1)
                sampling_seqs.append(seq)
        if not sampling_seqs:
            return [], []
        if len(rows) < hidden.shape[0]:  # else every row samples (a decode-only step): no gather, no copy
            hidden = hidden[torch.tensor(rows).to(self.device, non_blocking=True)]
        logits = self.model.compute_logits(hidden)
        sampling = SamplingBatch.build(
            [seq.params for seq in sampling_seqs], [seq.seed for seq in sampling_seqs],
            [seq.num_output_tokens for seq in sampling_seqs], [seq.penalty_state for seq in sampling_seqs],
            self.eos_token_ids, logits.shape[-1], self.device)
        return sampling_seqs, self.sampler(logits, sampling).tolist()
