"""What every attention implementation receives about one step's flat, unpadded batch, and the one place it is built."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """One step's batch of B sequences whose new tokens are laid end to end (T tokens in all).

    Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; those tokens sit at the last
    query_len positions of its context of seq_lens[i] tokens (cached prefix + new tokens), whose KV
    lives in the blocks block_tables[i, :ceil(seq_lens[i] / block_size)]. Decodes (query length 1)
    come first: sequences [0, num_decodes) are decodes, the rest are prefills (or prefill chunks).
    """

    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], unused entries are 0
    slot_mapping: torch.Tensor  # int64 [T]: flat cache slot (block * block_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # The decode rows cut into length-sorted groups (see group_decodes); filled in once per metadata, so once per
    # step rather than once per layer.
    decode_groups: list[list[int]] | None = None
    # The sliding-window layers' view of the same step when their KV lives in a group of its own (the engine's local
    # KV group): its block_tables and slot_mapping are that group's, everything else is this. None: every layer
    # reads these tables.
    local: "AttentionMetadata | None" = None

    def __post_init__(self) -> None:
        if self.decode_groups is None:
            self.decode_groups = group_decodes(self.seq_lens_cpu[: self.num_decodes])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def with_local_tables(self, block_tables: np.ndarray | torch.Tensor, slot_mapping: np.ndarray | torch.Tensor,
                          device: torch.device | str) -> "AttentionMetadata":
        """This metadata with `local` set: the same step over another KV group's block tables and slots."""
        self.local = dataclasses.replace(self, block_tables=_to(block_tables, device),
                                         slot_mapping=_to(slot_mapping, device), local=None)
        return self

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: np.ndarray | torch.Tensor,
              slot_mapping: np.ndarray | torch.Tensor, device: torch.device | str,
              device_seq_lens: torch.Tensor | None = None) -> "AttentionMetadata":
        """Metadata of a step whose sequence i adds query_lens[i] tokens to reach seq_lens[i] (decodes first).
        Host arrays are copied to `device` (asynchronously where the host memory allows); tensors are used as
        they are. `device_seq_lens` replaces the device copy of seq_lens: CUDA graphs read the real lengths
        from a static buffer while `seq_lens` holds their upper bounds."""
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        if device_seq_lens is None:
            device_seq_lens = _to(np.asarray(seq_lens, dtype=np.int32), device)
        return cls(query_start_loc=_to(query_start_loc, device), seq_lens=device_seq_lens,
                   block_tables=_to(block_tables, device), slot_mapping=_to(slot_mapping, device),
                   max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                   num_decodes=sum(1 for n in query_lens if n == 1), query_lens_cpu=list(query_lens),
                   seq_lens_cpu=list(seq_lens))


def group_decodes(seq_lens: list[int], tokens_per_group: int = 4096) -> list[list[int]]:
    """Decode rows sorted by context length and cut into groups of about `tokens_per_group` gathered tokens. The
    torch reference gathers each group only up to its own longest context, and its K/V stay small enough for the
    CPU's caches (one gather of a whole large batch is 3-4x slower: see docs/performance.md)."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    for row in order:
        if groups and (len(groups[-1]) + 1) * seq_lens[row] <= tokens_per_group:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _to(array: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array.to(device, non_blocking=True)
    return torch.from_numpy(array).to(device, non_blocking=True)


def kernel_window(window: int | None) -> int:
    """A sliding window as the kernels take it, an int argument whatever the layer: its size, or -1 for none (full
    causal attention). So one compiled kernel serves a model's local and global layers alike."""
    if window is None:
        return -1
    if window < 1:
        raise ValueError(f"a sliding window must be at least 1 key, got {window}")
    return int(window)
