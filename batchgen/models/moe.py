"""A sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: moe_models.py) over the flat batch of
tokens: a router picks each token's top-k experts, the tokens are grouped by expert and each active expert runs once
per step on its rows (gate/up in one matmul, then down), and each token's expert outputs are summed with its routing
weights.

Numerics follow transformers 5's default experts path (integrations/moe.py `grouped_mm_experts_forward`): router
logits in the model's dtype, softmax in fp32, top-k, optionally renormalised; the weights cast to the model's dtype
(Mixtral keeps them fp32, so its products are fp32); each (token, expert) output times its weight, then summed over
the k slots in slot order and rounded to the model's dtype once.

Each expert is a pair of nn.Linear layers, so the loader packs each one as it is read (oneDNN, packed_linear.py) as
it packs the dense layers. Measured on this project's 2-core AVX-512 machine (dev/microbench_moe.py, bf16, hidden
2048, 16 experts of 4096, top-2), one expert PackedLinear per active expert beat the experts stacked in one tensor
(F.linear on each expert's slice, or torch's grouped_mm) at every token count: 1.3-1.5x at 1 to 64 tokens, 1.1x at
512 (docs/moe.md).

On CUDA the loop above would read each expert's row count back to the host every layer (no CUDA graph could capture
it): there the block stacks its experts' weights once, on its first CUDA forward, into one [E, 2I, H] and one
[E, H, I] tensor, each expert's Linear weight becoming a view into them (one copy of the weights), and runs them
with two grouped Triton launches (batchgen_kernels/triton_moe.py, the same numerics). The CPU path is run_experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MoeSettings:
    """One sparse MLP's shape and routing rule, as its architecture reads them from the config (moe_models.py)."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    normalize_top_k: bool  # the top-k probabilities divided by their sum (transformers' norm_topk_prob)
    fp32_weights: bool = False  # Mixtral: the routing weights stay fp32 (not cast to the model's dtype)
    shared_expert_intermediate: int = 0  # Qwen2-MoE: a dense expert every token goes through, sigmoid-gated


def route(logits: torch.Tensor, settings: MoeSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (routing weights [T, k], expert ids [T, k]), as transformers' TopKRouter computes them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, settings.top_k, dim=-1)
    if settings.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if settings.fp32_weights else weights.to(logits.dtype)), experts


class Expert(nn.Module):
    """One expert: SwiGLU, gate and up in one matmul (the checkpoint's gate_proj and up_proj concatenated)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


def run_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                ops) -> torch.Tensor:
    """x [T, H], routing weights and expert ids [T, k] → [T, H]: the sum over k of weight x expert(x), each active
    expert run once on the rows routed to it. Each expert's weighted rows go straight to their (token, slot) row of
    one [T * k, H] buffer: no other buffer of that size is held (a Qwen3-30B prefill step of 4,096 tokens routes
    32,768 rows)."""
    num_tokens, top_k = expert_ids.shape
    slots = expert_ids.reshape(-1)  # slot t * k + j: token t's j-th expert
    order = torch.argsort(slots, stable=True)  # the slots grouped by expert
    counts = torch.bincount(slots, minlength=len(experts)).tolist()
    slot_weights = weights.reshape(-1, 1)
    by_slot, start = None, 0
    for expert, count in zip(experts, counts):
        if count:
            slot = order[start:start + count]
            start += count
            out = expert(x[slot // top_k], ops) * slot_weights[slot]  # Mixtral's fp32 weights: an fp32 product
            if by_slot is None:
                by_slot = out.new_empty(num_tokens * top_k, out.shape[-1])
            by_slot[slot] = out
    if by_slot is None:  # no tokens
        return torch.zeros_like(x)
    return by_slot.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


class SparseMoeBlock(nn.Module):
    """The layer's MLP: the router (`gate`, an nn.Linear [E, H]: packed like the experts), the experts, and
    Qwen2-MoE's shared expert with its sigmoid gate. Parameter names mirror transformers' checkpoints (`mlp.gate`,
    `mlp.experts.N....`, `mlp.shared_expert...`) except the fused gate/up projections."""

    def __init__(self, hidden_size: int, settings: MoeSettings, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.gate = nn.Linear(hidden_size, settings.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden_size, settings.expert_intermediate)
                                     for _ in range(settings.num_experts))
        self.shared_expert = shared_expert
        self.shared_expert_gate = None if shared_expert is None else nn.Linear(hidden_size, 1, bias=False)
        # On CUDA: (gate_up [E, 2I, H], down [E, H, I]), the experts' weights stacked (stack_experts); not
        # registered, so the state dict and the parameters stay the per-expert Linears' (views into these). False:
        # found not stackable (run_experts runs them)
        self._stacked: tuple[torch.Tensor, torch.Tensor] | bool | None = None

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.settings)
        if x.is_cuda and self.stack_experts():
            from batchgen_kernels.triton_moe import grouped_experts

            out = grouped_experts(x, *self._stacked, weights, expert_ids, ops.silu_mul)
        else:
            out = run_experts(self.experts, x, weights, expert_ids, ops)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)
        return out

    def stack_experts(self) -> bool:
        """Stack the experts' weights into [E, 2I, H] and [E, H, I] tensors, once, and make each expert's Linear
        weight a view into them, so the weights are held once; True when they are (or already were) stacked on a
        CUDA device. Each expert's own tensor is released as soon as it is copied: the stacking holds at most one
        projection's stack of this layer on top of the weights. Experts that are not plain bias-free nn.Linear
        layers of one dtype on CUDA (a packed or quantized form), or without Triton, are left as they are: False,
        run_experts runs them. The engine's start-up calls it right after loading (engine/startup.py), before the
        profiling step sizes the KV cache; else the first CUDA forward does."""
        if self._stacked is False:
            return False
        gate_ups = [expert.gate_up_proj for expert in self.experts]
        downs = [expert.down_proj for expert in self.experts]
        if self._stacked is not None and gate_ups[0].weight.data_ptr() == self._stacked[0].data_ptr() \
                and downs[0].weight.data_ptr() == self._stacked[1].data_ptr():
            return True  # the usual case; a check that a move (model.to) has not replaced the views
        linears = gate_ups + downs
        first = gate_ups[0].weight
        if not first.is_cuda:
            return False
        if not all(type(linear) is nn.Linear and linear.bias is None and linear.weight.device == first.device
                   and linear.weight.dtype == first.dtype for linear in linears):
            self._stacked = False
            return False
        try:
            import batchgen_kernels.triton_moe  # noqa: F401 -- needs Triton
        except ImportError:
            self._stacked = False
            return False
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, even when the first forward is in
            self._stacked = (_stack_weights(gate_ups), _stack_weights(downs))  # inference mode
        return True


def _stack_weights(linears: list[nn.Linear]) -> torch.Tensor:
    """One [E, out, in] tensor of the Linears' weights; each Linear's weight becomes its slice (its old tensor freed
    as soon as it is copied)."""
    first = linears[0].weight
    stacked = torch.empty((len(linears), *first.shape), dtype=first.dtype, device=first.device)
    for index, linear in enumerate(linears):
        stacked[index].copy_(linear.weight)
        linear.weight = nn.Parameter(stacked[index], requires_grad=False)
    return stacked
