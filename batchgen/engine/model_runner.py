"""Turns one scheduled step into a flat varlen batch, runs the model over the paged KV cache, samples."""
from __future__ import annotations

import numpy as np
import torch

from batchgen_kernels import AttentionMetadata

from .cuda_graphs import DecodeGraphRunner
from .kv_pool import KVPoolSize
from .pooler import pool_rows
from .sampler import Sampler, SamplingBatch
from .sequence import Sequence, SequenceRole
from .sliding_window import KVLayout
from .speculative.verify import confirmed_rows
from .step_output import StepOutput


# Scored positions whose logits are made at once (SCORE sequences: `choice`): 64 x a 49k vocabulary = 12.6 MB fp32,
# and as much again for their log-softmax; a wave of a large `choice` scores a few thousand positions a step.
SCORE_CHUNK = 64


class GroupCache:
    """One KV group's cache: a single allocation [its layers, 2 (K, V), blocks, block_size, Hkv, D].

    The torch attention reads whole blocks and masks the positions past a sequence's end, and a masked NaN from
    uninitialised memory would still poison 0 * v, so a block is zeroed before its first use (zero_below); stale K/V
    of an earlier sequence is finite, hence safe. On the CPU the cache is left unwritten until then, so its pages
    become resident only as blocks are used. An int8 cache (engine.kv_cache_dtype) has its fp32 scales beside it,
    [its layers, 2, blocks, block_size, Hkv], zeroed and copied with it."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        on_cpu = device.type == "cpu"
        self.tensor = (torch.empty if on_cpu else torch.zeros)(shape, dtype=dtype, device=device)
        self.scales = None if dtype != torch.int8 else (torch.empty if on_cpu else torch.zeros)(
            shape[:-1], dtype=torch.float32, device=device)
        self.num_zeroed = 0 if on_cpu else num_blocks  # blocks [0, this) hold finite values

    def zero_below(self, num_blocks: int) -> None:
        """Zero blocks [num_zeroed, num_blocks) of every layer: the blocks the pool handed out for the first time
        (it hands out never-used blocks in id order)."""
        if num_blocks > self.num_zeroed:
            self.tensor[:, :, self.num_zeroed:num_blocks].zero_()
            if self.scales is not None:
                self.scales[:, :, self.num_zeroed:num_blocks].zero_()
            self.num_zeroed = num_blocks

    def copy(self, copies: list[tuple[int, int]], device: torch.device) -> None:
        """Copy whole blocks, every layer's K and V: (source id, destination id) pairs (copy on write). A layer at a
        time: the gathered sources of a wave of forks, every layer at once, would be a wave of whole blocks
        (hundreds of MiB) made and dropped in one step."""
        if copies:
            src = torch.tensor([c[0] for c in copies], device=device)
            dst = torch.tensor([c[1] for c in copies], device=device)
            for layer in self.tensor if self.scales is None else (*self.tensor, *self.scales):
                layer[:, dst] = layer[:, src]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPoolSize, layout: KVLayout, dtype: torch.dtype,
                 device: torch.device, eos_token_ids: list[int], attention_backend: str = "auto") -> None:
        self.model = model
        self.block_size = pool.block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.decode_graphs: DecodeGraphRunner | None = None  # set at startup on CUDA: decode-only steps
        self.classifier_head: torch.nn.Module | None = None  # task classify: the model's `score` (pooler.py)
        self.lora_slots = None  # lora.AdapterSlots with adapters: puts each step's adapters in the model's slots
        # The global group's cache (every layer's, without a local group) and the local group's.
        self.kv = GroupCache(model, len(layout.global_layers), pool.num_blocks, pool.block_size, dtype, device)
        self.local_kv = None if pool.local is None else GroupCache(
            model, len(layout.local_layers), pool.local.num_blocks, pool.block_size, dtype, device)
        caches = [None] * model.num_layers  # each layer's [2, blocks, block_size, Hkv, D]
        scales = [None] * model.num_layers  # an int8 cache's, each layer's (K scales, V scales)
        for group, layers in ((self.kv, layout.global_layers), (self.local_kv, layout.local_layers)):
            for index, layer in enumerate(layers):
                caches[layer] = group.tensor[index]
                if group.scales is not None:
                    scales[layer] = (group.scales[index, 0], group.scales[index, 1])
        model.bind_kv_cache([cache[0] for cache in caches], [cache[1] for cache in caches], attention_backend,
                            scales if dtype == torch.int8 else None)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The global group's cache (every layer's without a local group)."""
        return self.kv.tensor

    @property
    def num_zeroed_blocks(self) -> int:
        return self.kv.num_zeroed

    def zero_blocks_below(self, num_blocks: int, num_local_blocks: int = 0) -> None:
        """Zero the blocks the pools handed out for the first time: global blocks [.., num_blocks), local blocks
        [.., num_local_blocks)."""
        self.kv.zero_below(num_blocks)
        if self.local_kv is not None:
            self.local_kv.zero_below(num_local_blocks)

    def _prepare(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        # A speculating sequence's last token and guesses are attention rows of one query each, a decode's (its
        # table repeated, each seeing the keys up to its own position): they take the decode kernels, as they would
        # one at a time without speculation, not the prefill kernels' other arithmetic (bf16 tiles on AMX, say).
        rows = [(seq, n, 1 if seq.draft_token_ids else n) for seq, n in batch]
        query_lens = [q for _, n, q in rows for _ in range(n // q)]
        seq_lens = [seq.num_computed_tokens + end for seq, n, q in rows for end in range(q, n + 1, q)]
        block_tables = np.zeros((len(query_lens), -(-max(seq_lens) // bs)), dtype=np.int32)
        input_ids: list[int] = []
        positions = np.empty(sum(query_lens), dtype=np.int64)
        slot_mapping = np.empty_like(positions)
        local = self.local_kv is not None  # the local group's tables: 0 (its null block) where nothing is held
        local_tables = np.zeros_like(block_tables) if local else None
        local_slots = np.empty_like(positions) if local else None
        offset = table_row = 0
        for seq, n, q in rows:
            start = seq.num_computed_tokens
            table = slice(table_row, table_row + n // q)
            ids = seq.block_ids.array[: -(-(start + n) // bs)]  # not the slots of guesses that fell: written over
            block_tables[table, : len(ids)] = ids
            input_ids.extend(seq.token_ids[start:start + n])
            if seq.draft_token_ids:  # its last token's n - 1 guesses follow it (speculative decoding)
                input_ids.extend(seq.draft_token_ids)
            pos = np.arange(start, start + n)
            positions[offset:offset + n] = pos
            slot_mapping[offset:offset + n] = ids[pos // bs].astype(np.int64) * bs + pos % bs
            if local:
                ids = seq.local_block_ids.array[: -(-(start + n) // bs)]
                local_tables[table, : len(ids)] = ids
                local_slots[offset:offset + n] = ids[pos // bs].astype(np.int64) * bs + pos % bs
            offset += n
            table_row += n // q
        metadata = AttentionMetadata.build(query_lens, seq_lens, block_tables, slot_mapping, self.device)
        if local:
            metadata.with_local_tables(local_tables, local_slots, self.device)
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.from_numpy(positions).to(self.device, non_blocking=True), metadata)

    def copy_blocks(self, copies: list[tuple[int, int]], local_copies: list[tuple[int, int]] = ()) -> None:
        """The copies on write of the global group and of the local one: (source id, destination id) pairs."""
        self.kv.copy(copies, self.device)
        if local_copies:
            self.local_kv.copy(local_copies, self.device)

    @torch.inference_mode()
    def execute(self, scheduled: dict[Sequence, int]) -> StepOutput:
        """Run one step: sample a token for each GENERATE sequence that reached its last token, score the
        positions of SCORE sequences, keep what POOL sequences pool."""
        # Decodes (one new token, and any guesses after it) first: the attention backends batch them together. Then,
        # within each, the rows of one LoRA adapter together: its product runs once over them (lora_linear.py).
        slots = {}
        if self.lora_slots is not None:
            slots = self.lora_slots.assign({seq.adapter.name for seq in scheduled if seq.adapter.name is not None})
        batch = sorted(scheduled.items(), key=lambda item: (item[1] - len(item[0].draft_token_ids) != 1,
                                                            slots.get(item[0].adapter.name, 0)))
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            hidden = self.decode_graphs.run(batch)
        else:
            input_ids, positions, metadata = self._prepare(batch)
            if self.lora_slots is not None:
                self.lora_slots.context.set_segments(adapter_segments(batch, slots))
            hidden = self.model(input_ids, positions, metadata)

        rows, sampling_seqs, offsets = [], [], []  # the rows that sample: their sequence, and how many guesses before
        score_rows, scoring = [], []  # the rows of scored positions, and (sequence, first position, count)
        pooling = []  # POOL sequences: (sequence, first row, rows)
        end = 0
        for seq, n in batch:
            start, end = end, end + n
            if seq.samples:
                guesses = len(seq.draft_token_ids)
                if seq.num_computed_tokens + n == seq.num_tokens + guesses:  # its last token and each guess sample
                    rows.extend(range(end - 1 - guesses, end))
                    sampling_seqs.extend([seq] * (guesses + 1))
                    offsets.extend(range(guesses + 1))
            elif seq.role is SequenceRole.SCORE:
                first = max(seq.num_computed_tokens, seq.score_from)  # positions computed now that are scored
                count = min(seq.num_computed_tokens + n, seq.score_until) - first
                if count > 0:
                    scoring.append((seq, first, count))
                    offset = start + first - seq.num_computed_tokens
                    score_rows.extend(range(offset, offset + count))
            elif seq.role is SequenceRole.POOL:
                pooling.append((seq, start, n))
        out = StepOutput()
        if scoring:
            out.scores = self._scores(hidden, score_rows, scoring)
        if pooling:
            out.pooled = pool_rows(hidden, pooling, self.classifier_head)
        if sampling_seqs:
            if len(rows) < hidden.shape[0]:  # else every row samples (a decode-only step): no gather, no copy
                hidden = hidden[torch.tensor(rows).to(self.device, non_blocking=True)]
            self._sample(self.model.compute_logits(hidden), sampling_seqs, offsets, out)
        return out

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], offsets: list[int], out: StepOutput) -> None:
        """A token for each row; a row `offsets[row]` positions after its sequence's last token is one of its
        guesses' rows, and its guesses are kept up to the first one its own draw differs from (verify.py)."""
        wants_logprobs = [seq.params.logprobs is not None for seq in seqs]
        if any(wants_logprobs):  # the model's own distribution: before penalties, masks and temperature
            logprobs = torch.log_softmax(logits.float(), dim=-1)
        matchers = {row: seq.matcher for row, seq in enumerate(seqs) if seq.matcher is not None}
        sampling = SamplingBatch.build(
            [seq.params for seq in seqs], [seq.seed for seq in seqs],
            [seq.num_output_tokens + offset for seq, offset in zip(seqs, offsets)], [seq.penalty_state for seq in seqs],
            self.eos_token_ids, logits.shape[-1], self.device, matchers=matchers or None)
        tokens = self.sampler(logits, sampling).tolist()
        kept = confirmed_rows(seqs, offsets, tokens)
        out.sampled, out.tokens = [seqs[row] for row in kept], [tokens[row] for row in kept]
        out.logprobs = [None] * len(kept)
        if any(wants_logprobs):
            chosen = logprobs.gather(-1, torch.tensor(tokens, device=logits.device).view(-1, 1)).squeeze(-1).tolist()
            k = max(seq.params.logprobs for seq in seqs if seq.params.logprobs is not None)
            tops = _top(logprobs, k)
            for index, row in enumerate(kept):
                if wants_logprobs[row]:
                    out.logprobs[index] = (chosen[row], tops[row][: seqs[row].params.logprobs])

    def _scores(self, hidden: torch.Tensor, rows: list[int], scoring: list[tuple[Sequence, int, int]]):
        """Per SCORE sequence: the logprob of the token after each scored position (hidden rows `rows`, in order);
        after its last token, of ending there (any EOS token). The logits are made SCORE_CHUNK rows at a time:
        a labeling step scores thousands of positions, and [rows, V] fp32 logits of them all would not be small."""
        targets = []
        for seq, first, count in scoring:
            following = seq.token_ids[first + 1:first + 1 + count]
            targets.extend(following + [-1] * (count - len(following)))  # -1: the end, after the last token
        k = max((seq.params.logprobs or 0) for seq, _, _ in scoring)
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)
        values, tops = [], []
        for start in range(0, len(rows), SCORE_CHUNK):
            index = torch.tensor(rows[start:start + SCORE_CHUNK]).to(self.device, non_blocking=True)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[index]).float(), dim=-1)
            target = torch.tensor(targets[start:start + SCORE_CHUNK], dtype=torch.long, device=self.device)
            chosen = logprobs.gather(-1, target.clamp(min=0).view(-1, 1)).squeeze(-1)
            values += torch.where(target < 0, logprobs[:, eos].logsumexp(dim=-1), chosen).tolist()
            if k:
                tops += _top(logprobs, k)
        result, row = [], 0
        for seq, first, count in scoring:
            seq_tops = None
            if seq.params.logprobs is not None:
                seq_tops = [top[: seq.params.logprobs] for top in tops[row:row + count]]
            result.append((seq, first, values[row:row + count], seq_tops))
            row += count
        return result


def _top(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's k most likely tokens as (id, logprob), best first."""
    if k == 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = logprobs.topk(k, dim=-1)
    return [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]


def adapter_segments(batch: list[tuple[Sequence, int]], slots: dict[str, int]) -> list[tuple[int, int, int]]:
    """(first row, end row, adapter slot) of each run of rows of one adapter, in the batch's order; `slots`: each
    adapter's slot this step (the base model's is 0)."""
    segments, row = [], 0
    for seq, n in batch:
        slot = slots.get(seq.adapter.name, 0)
        if segments and segments[-1][2] == slot:
            segments[-1] = (segments[-1][0], row + n, slot)
        else:
            segments.append((row, row + n, slot))
        row += n
    return segments
