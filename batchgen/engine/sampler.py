"""Turns a step's logits into one token per sequence: grammar masks, penalties, min_tokens masking, temperature,
top-k, top-p, min-p, then a draw whose randomness depends only on the request's (seed, output position).

Order (vLLM's): the grammar's token bitmask, then penalties and min_tokens masking on the logits (greedy rows take
the argmax here), then temperature -> top-k -> top-p -> min-p -> sample.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .request import SamplingParams

# Temperatures below this are treated as greedy (as vLLM does): dividing by them would overflow the logits.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingBatch:
    """One row per sequence that samples this step. On the greedy fast path only `all_greedy` (and the row count)
    is set: no tensor is built."""

    num_rows: int
    all_greedy: bool  # no row samples at random
    any_penalty: bool
    # Random-row settings, [B]; None when all_greedy.
    greedy_rows: Tensor | None = None  # bool
    temperature: Tensor | None = None  # fp32, 1.0 on greedy rows
    top_k: Tensor | None = None  # int64, V where off
    top_p: Tensor | None = None  # fp32
    min_p: Tensor | None = None  # fp32
    seeds: Tensor | None = None  # int64 (seed taken modulo 2**64)
    positions: Tensor | None = None  # int64, index of the output token being sampled
    needs_top_k: bool = False
    max_top_k: int = 0  # largest top_k over the random rows; V if any of them has top-k off
    needs_top_p: bool = False
    needs_min_p: bool = False
    # Penalties, [B] and [B, V]; None when no row has any.
    repetition_penalty: Tensor | None = None
    presence_penalty: Tensor | None = None
    frequency_penalty: Tensor | None = None
    seen_mask: Tensor | None = None  # bool [B, V]: token occurs in prompt or output (repetition penalty)
    output_counts: Tensor | None = None  # fp32 [B, V]: occurrences in the output (presence/frequency)
    # min_tokens: logits[banned_rows, banned_tokens] = -inf; None when no row is below its min_tokens.
    banned_rows: Tensor | None = None
    banned_tokens: Tensor | None = None
    # Grammar-constrained rows: row -> its structured.Matcher; None when no row is constrained.
    matchers: dict | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], num_output_tokens: list[int],
              penalty_states: list["PenaltyState | None"], eos_token_ids: list[int], vocab_size: int,
              device, matchers: dict | None = None) -> "SamplingBatch":
        """penalty_states: each row's PenaltyState, None for rows without a penalty."""
        num_rows = len(params)
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        banned = _min_tokens_bans(params, num_output_tokens, eos_token_ids, vocab_size)
        batch = cls(num_rows, all(greedy), any(state is not None for state in penalty_states), matchers=matchers)
        if banned:
            batch.banned_rows = torch.tensor([row for row, _ in banned], dtype=torch.long, device=device)
            batch.banned_tokens = torch.tensor([token for _, token in banned], dtype=torch.long, device=device)
        if batch.any_penalty:
            batch._build_penalties(params, penalty_states, vocab_size, device)
        if not batch.all_greedy:
            batch._build_random(params, greedy, seeds, num_output_tokens, vocab_size, device)
        return batch

    def _build_penalties(self, params, penalty_states, vocab_size, device) -> None:
        def floats(values):
            return torch.tensor(values, dtype=torch.float32, device=device)

        self.repetition_penalty = floats([p.repetition_penalty for p in params])
        self.presence_penalty = floats([p.presence_penalty for p in params])
        self.frequency_penalty = floats([p.frequency_penalty for p in params])
        no_tokens = None
        seen, counts = [], []
        for state in penalty_states:
            if state is None:
                if no_tokens is None:
                    no_tokens = PenaltyState([], vocab_size, device)
                state = no_tokens
            seen.append(state.seen)
            counts.append(state.output_counts)
        self.seen_mask = torch.stack(seen)
        self.output_counts = torch.stack(counts)

    def _build_random(self, params, greedy, seeds, num_output_tokens, vocab_size, device) -> None:
        def top_k_or_off(k: int) -> int:
            return vocab_size if k <= 0 or k >= vocab_size else int(k)

        self.greedy_rows = torch.tensor(greedy, dtype=torch.bool, device=device)
        self.temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                        dtype=torch.float32, device=device)
        top_k = [top_k_or_off(p.top_k) for p in params]
        self.top_k = torch.tensor(top_k, dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        self.seeds = torch.tensor([_to_signed(int(s)) for s in seeds], dtype=torch.long, device=device)
        self.positions = torch.tensor(num_output_tokens, dtype=torch.long, device=device)
        random_params = [p for p, g in zip(params, greedy) if not g]
        self.max_top_k = max(top_k_or_off(p.top_k) for p in random_params)
        self.needs_top_k = any(top_k_or_off(p.top_k) < vocab_size for p in random_params)
        self.needs_top_p = any(p.top_p < 1.0 for p in random_params)
        self.needs_min_p = any(p.min_p > 0.0 for p in random_params)


class PenaltyState:
    """A penalised request's token statistics over the logits' vocabulary, kept up to date token by token instead
    of being rebuilt from its token lists every step: which tokens occur in its prompt or output (repetition
    penalty) and how often each occurs in its output (presence and frequency penalties). Ids outside the logits
    (an embedding vocabulary larger than lm_head) are ignored."""

    def __init__(self, prompt_ids: list[int], vocab_size: int, device) -> None:
        self.vocab_size = vocab_size
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        self.seen[ids[(ids >= 0) & (ids < vocab_size)].to(device)] = True

    @classmethod
    def from_tokens(cls, prompt_ids: list[int], output_ids: list[int], vocab_size: int, device) -> "PenaltyState":
        state = cls(prompt_ids, vocab_size, device)
        for token in output_ids:
            state.append(token)
        return state

    def append(self, token: int) -> None:
        if 0 <= token < self.vocab_size:
            self.seen[token] = True
            self.output_counts[token] += 1


def has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


class Sampler:
    def __init__(self) -> None:
        self._bitmask = None  # a structured.TokenBitmask, made for the first constrained row

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """logits: [B, V] fp32, one row per row of `batch`. Returns the sampled token ids, LongTensor [B]."""
        if batch.all_greedy and not batch.any_penalty and batch.banned_rows is None and batch.matchers is None:
            return logits.argmax(dim=-1)
        logits = logits.float().clone()
        if batch.matchers is not None:
            if self._bitmask is None:
                from .structured import TokenBitmask
                self._bitmask = TokenBitmask(logits.shape[-1])
            self._bitmask.apply(logits, batch.matchers)
        if batch.any_penalty:
            logits = apply_penalties(logits, batch)
        if batch.banned_rows is not None:
            logits[batch.banned_rows, batch.banned_tokens] = float("-inf")
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        rows = (~batch.greedy_rows).nonzero().squeeze(1)
        sampled = self._sample(logits[rows] / batch.temperature[rows, None], batch, rows)
        return greedy_tokens.index_copy(0, rows, sampled)

    def _sample(self, logits: Tensor, batch: SamplingBatch, rows: Tensor) -> Tensor:
        """Sample from temperature-scaled logits [R, V]. Works on each row's candidates, best first: its top
        max_top_k (when every row has a top-k), all tokens sorted (for top-p), or all tokens in vocab order.
        Every step after choosing candidates is elementwise, or a prefix sum, so a row's token does not depend on
        which of these paths the batch took."""
        vocab_size = logits.shape[-1]
        if batch.max_top_k < vocab_size:
            values, token_ids = logits.topk(batch.max_top_k, dim=-1)
        elif batch.needs_top_k or batch.needs_top_p:
            values, token_ids = logits.sort(dim=-1, descending=True, stable=True)
        else:
            values, token_ids = logits, torch.arange(vocab_size, device=logits.device).expand_as(logits)
        if batch.needs_top_k or batch.needs_top_p:
            values = mask_top_k_top_p(values, batch.top_k[rows] if batch.needs_top_k else None,
                                      batch.top_p[rows] if batch.needs_top_p else None)
        # Unnormalised probabilities, 1 at each row's best token: min-p and the draw need no normalising.
        weights = (values - values.amax(dim=-1, keepdim=True)).exp()
        if batch.needs_min_p:
            weights = weights.masked_fill(weights < batch.min_p[rows, None], 0.0)
        # Exponential race: argmax(w_i / E_i) with E_i ~ Exp(1) independent picks i with probability w_i / sum(w).
        exponentials = -torch.log(hash_uniforms(batch.seeds[rows], batch.positions[rows], token_ids))
        choice = (weights / exponentials).argmax(dim=-1, keepdim=True)
        return token_ids.gather(-1, choice).squeeze(-1)


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition penalty over prompt+output tokens (HF: positive logits divided, negative multiplied), then
    presence and frequency penalties over output tokens (logit -= presence * [count > 0] + frequency * count)."""
    penalty = batch.repetition_penalty[:, None]
    repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(batch.seen_mask, repeated, logits)
    counts = batch.output_counts
    return logits - batch.frequency_penalty[:, None] * counts - batch.presence_penalty[:, None] * (counts > 0)


def mask_top_k_top_p(values: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """values: [R, K] candidate logits sorted best first. Set to -inf those outside each row's top-k, then those
    outside its top-p nucleus. top_k: [R] int64 (>= K where off); top_p: [R] fp32 (1.0 where off); None = off."""
    ranks = torch.arange(values.shape[-1], device=values.device)
    if top_k is not None:
        values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        weights = (values - values[:, :1]).exp()
        cumulative = weights.cumsum(dim=-1)
        mass_before = cumulative - weights  # mass of the strictly better-ranked candidates
        # Keep a candidate while the better ones hold less than top_p of the mass (the best is always kept). The
        # total is the prefix sum's last entry, so candidates past the nucleus (zeros) cannot change it.
        outside = (mass_before >= top_p[:, None] * cumulative[:, -1:]) & (top_p[:, None] < 1.0) & (ranks > 0)
        values = values.masked_fill(outside, float("-inf"))
    return values


# --- counter-based random numbers ------------------------------------------------------------------------------------
# Per row, splitmix64 (Steele et al. 2014) turns (seed, position) into a 64-bit key; per token, two rounds of the
# 32-bit `lowbias32` mixer (Wellons), keyed by the key's two halves, turn the token id into 32 random bits.
# 32-bit lanes: int64 multiplication has no SIMD instruction on common CPUs, and the [B, V] pass is the hot one.
# In torch, integer multiplication and addition wrap as in C, and `>>` is arithmetic on signed integers, so every
# right shift is masked back to a logical one.

def _to_signed(value: int, bits: int = 64) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


_GOLDEN_GAMMA = _to_signed(0x9E3779B97F4A7C15)
_MIX64_1 = _to_signed(0xBF58476D1CE4E5B9)
_MIX64_2 = _to_signed(0x94D049BB133111EB)
_MIX32_1 = _to_signed(0x7FEB352D, 32)
_MIX32_2 = _to_signed(0x846CA68B, 32)
_UNIFORM_BITS = 23  # (2m + 1) / 2**24 is then exact in fp32 and lies strictly inside (0, 1)


def _xor_shift_right_(x: Tensor, bits: int, scratch: Tensor) -> Tensor:
    """x ^= x >>> bits (logical shift), in place."""
    width = 8 * x.element_size()
    return x.bitwise_xor_(torch.bitwise_right_shift(x, bits, out=scratch).bitwise_and_((1 << (width - bits)) - 1))


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64, in place: a bijection with full avalanche."""
    scratch = torch.empty_like(x)
    _xor_shift_right_(x, 30, scratch).mul_(_MIX64_1)
    _xor_shift_right_(x, 27, scratch).mul_(_MIX64_2)
    return _xor_shift_right_(x, 31, scratch)


def mix32(x: Tensor, scratch: Tensor) -> Tensor:
    """lowbias32 on int32, in place: a bijection on 32 bits."""
    _xor_shift_right_(x, 16, scratch).mul_(_MIX32_1)
    _xor_shift_right_(x, 15, scratch).mul_(_MIX32_2)
    return _xor_shift_right_(x, 16, scratch)


def hash_uniforms(seeds: Tensor, positions: Tensor, token_ids: Tensor) -> Tensor:
    """Uniforms in (0, 1), fp32 [B, N]: entry (b, n) is a hash of (seeds[b], positions[b], token_ids[b, n]) and of
    nothing else (not the batch, its order or the step). seeds, positions: [B] int64; token_ids: [B, N] int64."""
    keys = mix64(mix64(seeds.clone()) ^ mix64(positions + _GOLDEN_GAMMA))
    low = _int32(keys & 0xFFFFFFFF)
    high = _int32(torch.bitwise_right_shift(keys, 32) & 0xFFFFFFFF)
    x = token_ids.to(torch.int32) ^ low[:, None]
    scratch = torch.empty_like(x)
    mix32(x, scratch).add_(high[:, None])
    mix32(x, scratch)
    bits = torch.bitwise_right_shift(x, 32 - _UNIFORM_BITS, out=scratch).bitwise_and_((1 << _UNIFORM_BITS) - 1)
    return bits.float().mul_(2.0).add_(1.0).mul_(2.0 ** -(_UNIFORM_BITS + 1))


def _int32(values: Tensor) -> Tensor:
    """int64 values in [0, 2**32) to the int32 with the same bits."""
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


# --- build helpers ----------------------------------------------------------------------------------------------------

def _min_tokens_bans(params: list[SamplingParams], num_output_tokens: list[int], eos_token_ids: list[int],
                     vocab_size: int) -> list[tuple[int, int]]:
    """(row, token) pairs to mask: while a row has fewer than min_tokens outputs, its stop_token_ids and (unless
    ignore_eos, where EOS stops nothing) the EOS ids, as vLLM's MinTokensLogitsProcessor does."""
    banned = []
    for row, p in enumerate(params):
        if p.min_tokens and num_output_tokens[row] < p.min_tokens:
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(eos_token_ids)
            banned.extend((row, token) for token in sorted(stops) if 0 <= token < vocab_size)
    return banned
