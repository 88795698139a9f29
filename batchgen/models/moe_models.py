"""The sparse mixture-of-experts decoders: Llama's layers (llama.py) with a SparseMoeBlock (moe.py) as the MLP of
their sparse layers. What each reads from its config, as transformers 5.25's modeling code does:

- Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, when num_experts > 0 and (i + 1) is a multiple of
  decoder_sparse_step; else a dense SwiGLU of intermediate_size. Experts of moe_intermediate_size; norm_topk_prob.
  Its attention's per-head q/k norms are the registry's variant.
- Qwen2-MoE: the same rule, and a shared expert (a SwiGLU of shared_expert_intermediate_size) every token goes
  through, scaled by sigmoid(shared_expert_gate(x)) and added to the routed experts' sum.
- Mixtral: every layer sparse, experts of intermediate_size, the top-k weights always renormalised and kept in fp32.
  Its checkpoints name the block `block_sparse_moe` and an expert's gate, up and down projections w1, w3, w2.
- OLMoE: every layer sparse, experts of intermediate_size, norm_topk_prob. Its attention normalises q and k over
  the whole projection and clamps q, k, v to clip_qkv (the registry's variant; llama.SelfAttention).
"""
from __future__ import annotations

from torch import nn

from .llama import MLP, LlamaForCausalLM, LlamaVariant
from .moe import MoeSettings, SparseMoeBlock


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers' MLP is a SparseMoeBlock; `num_experts` is per sparse layer."""

    def __init__(self, config, variant: LlamaVariant) -> None:
        super().__init__(config, variant)
        self.num_experts = self.moe_settings().num_experts

    def layer_mlp(self, layer: int) -> nn.Module | None:
        settings = self.moe_settings()
        if not self.sparse(layer):
            return None
        shared = None
        if settings.shared_expert_intermediate:
            shared = MLP(self.config, self.variant, settings.shared_expert_intermediate)
        return SparseMoeBlock(self.config.hidden_size, settings, shared)

    def moe_settings(self) -> MoeSettings:
        raise NotImplementedError

    def sparse(self, layer: int) -> bool:
        return True


class Qwen3MoeForCausalLM(MoeForCausalLM):
    def moe_settings(self) -> MoeSettings:
        c = self.config
        return MoeSettings(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, bool(c.norm_topk_prob))

    def sparse(self, layer: int) -> bool:
        c = self.config
        return layer not in (c.mlp_only_layers or []) and c.num_experts > 0 and \
            (layer + 1) % c.decoder_sparse_step == 0


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    def moe_settings(self) -> MoeSettings:
        c = self.config
        return MoeSettings(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, bool(c.norm_topk_prob),
                           shared_expert_intermediate=c.shared_expert_intermediate_size)


class MixtralForCausalLM(MoeForCausalLM):
    def moe_settings(self) -> MoeSettings:
        c = self.config
        return MoeSettings(c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, normalize_top_k=True,
                           fp32_weights=True)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The checkpoint's name for a tensor we name as Qwen's MoE checkpoints do (inspector.checkpoint_sources)."""
        if ".mlp." not in name:
            return name
        name = name.replace(".mlp.", ".block_sparse_moe.")
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            name = name.replace(f".{ours}.", f".{theirs}.")
        return name


class OlmoeForCausalLM(MoeForCausalLM):
    def moe_settings(self) -> MoeSettings:
        c = self.config
        return MoeSettings(c.num_experts, c.num_experts_per_tok, c.intermediate_size, bool(c.norm_topk_prob))
