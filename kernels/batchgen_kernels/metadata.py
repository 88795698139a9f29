"""What every attention implementation receives about one step's flat, unpadded batch."""
from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes
