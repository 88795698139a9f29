"""The generic model path: a decoder without a native implementation in batchgen runs as transformers' own modeling
code, with batchgen's paged attention plugged in through transformers' attention interface (generic_attention.py).

The engine sees what it sees of a native model (llama.CausalLM's contract): forward(input_ids, positions, metadata)
over the step's flat batch → final hidden states, compute_logits, bind_kv_cache, sliding_windows, the shapes. The
transformers model gets the batch as one row of tokens with each token's own position id, no cache object and no
mask; every token's keys and values go to the paged cache, and each query attends over its own sequence's context
there. Whatever the architecture does around attention (its norms, RoPE variants, MoE blocks, MLA projections,
logit scaling and softcapping) is transformers' code, so greedy output equals transformers'. Which architectures can
take this path, and which are refused before any weight loads, is generic_support.py's.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache, partial

import torch
from torch import nn

from .attention import Attention
from .generic_attention import LayerBinding, StepContext
from .generic_support import GenericShape, attention_modules


@lru_cache(maxsize=None)
def is_llama_rms_norm(module_class: type) -> bool:
    """Whether the class's forward is transformers' LlamaRMSNorm.forward, to the letter."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    forward = getattr(module_class, "forward", None)
    if module_class is LlamaRMSNorm:
        return True
    if not module_class.__name__.endswith("RMSNorm") or forward is None:
        return False
    try:
        return inspect.getsource(forward) == inspect.getsource(LlamaRMSNorm.forward)
    except (OSError, TypeError):
        return False


def _fused_rms_norm(rms_norm, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    return rms_norm(x.reshape(-1, shape[-1]).contiguous(), module.weight, module.variance_epsilon).view(shape)


@dataclass
class _HiddenStates:
    """Stands in for the base model while compute_logits runs the causal LM's own head on given hidden states."""

    hidden: torch.Tensor

    def __call__(self, *args, **kwargs):
        return _BaseOutput(last_hidden_state=self.hidden)

    def __getattr__(self, name: str):  # a head that calls a part of its base model (OPT: self.model.decoder)
        return self


class _BaseOutput(dict):
    """A base model's output holding only the hidden states: any other field a head reads (router logits, the
    cache, attentions) is None."""

    def __getattr__(self, name: str):
        return self.get(name)

    def __getitem__(self, key):
        return self["last_hidden_state"] if key == 0 else dict.__getitem__(self, key)


class TransformersCausalLM(nn.Module):
    """A transformers causal LM (built with attn_implementation=ATTENTION_NAME) behind the engine's model contract."""

    def __init__(self, hf_model: nn.Module, shape: GenericShape) -> None:
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        self.shape = shape
        self.num_layers = shape.num_layers
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.vocab_size = shape.vocab_size
        self.max_model_len = shape.max_model_len
        self.ops = None  # the native models' elementwise kernels: transformers' code runs its own ops
        self._step = StepContext()
        self._base_name = hf_model.base_model_prefix
        for module, window in zip(attention_modules(hf_model), shape.layer_windows):
            scale = getattr(module, "scaling", None) or shape.head_dim ** -0.5
            attention = Attention(shape.num_heads, shape.num_kv_heads, shape.head_dim, scale, window)
            module.batchgen = LayerBinding(attention, self._step, shape.value_dim, shape.softcap)

    @property
    def layers(self) -> list[Attention]:
        return [module.batchgen.attention for module in attention_modules(self.hf)]

    @property
    def input_embeddings(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    @property
    def output_head(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    @property
    def head_tied(self) -> bool:
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return bool(getattr(text, "tie_word_embeddings", False))

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                      attention_backend: str = "auto", kv_scales: list | None = None) -> None:
        if len(k_caches) != self.num_layers or len(v_caches) != self.num_layers:
            raise ValueError(f"need {self.num_layers} k and v caches, got {len(k_caches)} and {len(v_caches)}")
        scales = kv_scales or [None] * self.num_layers
        for attention, k_cache, v_cache, kv_scale in zip(self.layers, k_caches, v_caches, scales):
            attention.bind_kv_cache(k_cache, v_cache, attention_backend, kv_scale)

    def sliding_windows(self) -> list[int | None]:
        return list(self.shape.layer_windows)

    def use_elementwise(self, ops) -> None:
        """The fused RMSNorm (ops.rms_norm: batchgen_kernels.elementwise) for every norm whose transformers code is
        Llama's own, line for line (most decoders copy it): one kernel instead of eight small ops, which a decode
        step makes hundreds of. Any other norm, and every other op, runs as transformers wrote it."""
        for module in self.hf.modules():
            if is_llama_rms_norm(type(module)):
                module.forward = partial(_fused_rms_norm, ops.rms_norm, module)

    def tie_weights(self) -> None:
        """transformers tied them at load."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        """input_ids, positions: [T] (all sequences' new tokens end to end) → final hidden states [T, hidden]."""
        self._step.metadata = attn_metadata
        try:
            base = getattr(self.hf, self._base_name)
            out = base(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        finally:
            self._step.metadata = None
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → fp32 logits [N, vocab], through the causal LM's own head: its scaling and softcapping."""
        base = self.hf._modules[self._base_name]
        self.hf._modules[self._base_name] = _HiddenStates(hidden.unsqueeze(0))
        try:
            logits = self.hf(input_ids=None, use_cache=False).logits
        finally:
            self.hf._modules[self._base_name] = base
        return logits[0].float()
