"""Decode-only steps on static, padded input buffers, captured once per bucketed batch size as CUDA graphs.

In a step where every scheduled sequence adds exactly one token, the model's work depends on the number of
sequences alone. Padding that number up to a bucket (1, 2, 4, 8, 16, 24, ...) leaves few distinct shapes; each is
captured once and then replayed, which removes the per-kernel launch cost that dominates small decode batches.

Padding rows are inert: token 0 at position 0, KV slot -1 (the store kernel skips negative slots) and a context of
0 tokens (the decode kernel writes zeros for it), so they neither read nor write any sequence's cache. A graph
replays its kernels with the arguments they were captured with, so the attention metadata of a graph is fixed:
its max_seq_len is the engine's max_model_len, which only caps the decode kernel's number of splits (its grid);
each sequence is cut into those splits by its real length, on the device, so a short context in a graph captured
for a long one still uses them all (triton_decode.py). The block-table buffer is max_model_len / block_size wide.
A model with a local KV group (sliding-window layers, sliding_window.py) has a second block-table buffer and slot
row for that group, which the metadata's `local` view reads.

This needs the Triton backend (the torch reference cannot skip a slot). `capture=False` runs the same padded path
without graphs: that is how the CPU tests exercise it, under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import bisect
from collections import Counter

import torch

from batchgen_kernels import AttentionMetadata, get_backend, reference

from .sequence import Sequence


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below max_num_seqs, then max_num_seqs itself."""
    sizes = {size for size in (1, 2, 4) if size < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int:
    """The smallest bucket that holds num_seqs sequences."""
    index = bisect.bisect_left(sizes, num_seqs)
    if num_seqs < 1 or index == len(sizes):
        raise ValueError(f"no bucket for {num_seqs} sequences (buckets go up to {sizes[-1]})")
    return sizes[index]


def padded_decode_supported(device: torch.device, attention_backend: str = "auto") -> bool:
    """Whether the attention backend on `device` skips negative slots (padding rows), which this path needs."""
    try:
        return get_backend(device, attention_backend) is not reference
    except ImportError:
        return False


class DecodeGraphRunner:
    """Runs decode-only steps of up to max_num_seqs sequences on static buffers padded to a bucket size: as CUDA
    graphs replayed from a one-time capture (`capture=True`), or eagerly (`capture=False`, any device)."""

    def __init__(self, model: torch.nn.Module, block_size: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device, capture: bool, local_group: bool = False) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.capture = capture
        self.sizes = graph_batch_sizes(max_num_seqs)
        rows, max_blocks = self.sizes[-1], -(-max_model_len // block_size)

        # Host staging, pinned on CUDA so that the copies to the device are asynchronous. Tokens, positions and
        # slots (and the local group's slots) share one int64 buffer (one copy per step); padding rows keep token 0,
        # position 0, slot -1. A table buffer holds [B, width] per step, the local group's a second one.
        pin = device.type == "cuda"
        self.local_group = local_group
        self._host_tokens = torch.zeros((4 if local_group else 3, rows), dtype=torch.int64, pin_memory=pin)
        self._host_tokens[2:] = -1
        self._host_seq_lens = torch.zeros(rows, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros(rows * max_blocks, dtype=torch.int32, pin_memory=pin)
        self._host_local_tables = torch.zeros_like(self._host_tables) if local_group else None
        self._tokens_np, self._seq_lens_np = self._host_tokens.numpy(), self._host_seq_lens.numpy()
        self._tables_np = self._host_tables.numpy()
        # The next step must not overwrite the pinned buffers before the device has read them.
        self._copied = torch.cuda.Event() if pin else None

        # The device buffers every graph reads.
        self._tokens = self._host_tokens.to(device, copy=True)
        self.input_ids, self.positions, self.slot_mapping = self._tokens[0], self._tokens[1], self._tokens[2]
        self.local_slot_mapping = self._tokens[3] if local_group else None
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((rows, max_blocks), dtype=torch.int32, device=device)
        self.local_block_tables = torch.zeros_like(self.block_tables) if local_group else None

        self._metadata: dict[int, AttentionMetadata] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # one memory pool shared by every graph: they never run at the same time
        self.steps_by_size: Counter[int] = Counter()  # how often each bucket ran

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, batch: list[tuple[Sequence, int]]) -> bool:
        return len(batch) <= self.max_batch_size and all(n == 1 for _, n in batch)

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Final hidden states [len(batch), hidden] of a decode-only step, rows in `batch` order."""
        size = padded_batch_size(len(batch), self.sizes)
        if self.capture and size not in self._graphs:
            self._capture(size)
        self._stage(batch, size)
        self.steps_by_size[size] += 1
        if self.capture:
            graph, hidden = self._graphs[size]
            graph.replay()
        else:
            hidden = self.model(self.input_ids[:size], self.positions[:size], self.metadata(size))
        return hidden[: len(batch)]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now, largest first (the smaller graphs then fit in the memory the larger freed)."""
        for size in reversed(self.sizes):
            if size not in self._graphs:
                self._capture(size)

    def metadata(self, size: int) -> AttentionMetadata:
        """The fixed metadata of a `size`-row batch, over views of the static buffers. The host-side lengths are
        upper bounds: the real ones are on the device only."""
        if size not in self._metadata:
            metadata = AttentionMetadata.build(
                [1] * size, [self.max_model_len] * size, self.block_tables[:size], self.slot_mapping[:size],
                self.device, device_seq_lens=self.seq_lens[:size])
            if self.local_group:
                metadata.with_local_tables(self.local_block_tables[:size], self.local_slot_mapping[:size],
                                           self.device)
            self._metadata[size] = metadata
        return self._metadata[size]

    def _capture(self, size: int) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Capture over padding rows only, so that the warm-up passes write nothing into the KV cache.
        self._tokens[:2, :size] = 0
        self._tokens[2:, :size] = -1  # the slots
        self.seq_lens[:size] = 0
        args = (self.input_ids[:size], self.positions[:size], self.metadata(size))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # compile the kernels and settle the allocator outside the capture
            for _ in range(2):
                self.model(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self.model(*args)
        self._graphs[size] = (graph, hidden)

    def _stage(self, batch: list[tuple[Sequence, int]], size: int) -> None:
        """Write the step's inputs, padded to `size` rows, into the static device buffers."""
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: the previous step waited for its sampled tokens
        bs, num = self.block_size, len(batch)
        tokens, seq_lens = self._tokens_np, self._seq_lens_np
        width = max(seq.num_computed_tokens for seq, _ in batch) // bs + 1
        table = self._tables_np[: num * width].reshape(num, width)
        local = self._host_local_tables
        local_table = None if local is None else local.numpy()[: num * width].reshape(num, width)
        for row, (seq, _) in enumerate(batch):
            pos = seq.num_computed_tokens
            num_blocks = pos // bs + 1
            ids = seq.block_ids.array
            tokens[0, row] = seq.token_ids[pos]
            tokens[1, row] = pos
            tokens[2, row] = int(ids[num_blocks - 1]) * bs + pos % bs
            seq_lens[row] = pos + 1
            table[row, :num_blocks] = ids[:num_blocks]
            if local is not None:
                ids = seq.local_block_ids.array
                tokens[3, row] = int(ids[num_blocks - 1]) * bs + pos % bs
                local_table[row, :num_blocks] = ids[:num_blocks]
        tokens[:2, num:size] = 0
        tokens[2:, num:size] = -1
        seq_lens[num:size] = 0
        # Padding rows' table entries are left stale: a context of 0 tokens reads none of them, and a real row
        # reads only its first num_blocks entries.
        self._tokens.copy_(self._host_tokens, non_blocking=True)
        self.seq_lens.copy_(self._host_seq_lens, non_blocking=True)
        self.block_tables[:num, :width].copy_(self._host_tables[: num * width].view(num, width), non_blocking=True)
        if local is not None:
            self.local_block_tables[:num, :width].copy_(local[: num * width].view(num, width), non_blocking=True)
        if self._copied is not None:
            self._copied.record()
