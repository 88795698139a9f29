"""One layer's paged attention: store the step's new K/V in the cache, then attend over each sequence's context."""
from __future__ import annotations

import torch
from torch import nn

from batchgen_kernels import AttentionMetadata, get_backend


class Attention(nn.Module):
    """Holds this layer's KV cache ([num_blocks, block_size, num_kv_heads, head_dim] each) and the kernel backend.

    The cache is owned by the runner and bound after construction (`bind_kv_cache`); it is a plain attribute,
    not a buffer, so it never appears in state_dict and `model.to()` leaves it where the runner put it. An int8
    cache comes with its K and V scales (`kv_scales`, [num_blocks, block_size, num_kv_heads] each), which every
    store and attention call hands to the backend.

    Over an int8 cache q and k are first turned by one orthonormal Hadamard matrix R over head_dim: (qR)·(kR) = q·k,
    so the scores are unchanged, but a key's few large channels (trained models' keys have them) are spread over
    all of them before its per-token scale is taken, which int8 then resolves finer. On Gemma 3 270M in fp32, int8
    kept 114 of 128 `choice` labels unturned and 128 turned (docs/performance.md, "Issue 43: KV int8"). Values stay
    as they are: turning them too gained little there and costs a second product, on the output.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window  # a local layer: each query sees only its last `sliding_window` keys
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_kwargs: dict = {}
        self.rotation: torch.Tensor | None = None  # R, over an int8 cache only; in the activations' dtype once used
        self.backend = None

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: str = "auto",
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        expected = (self.num_kv_heads, self.head_dim)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.dim() != 4 or tuple(cache.shape[2:]) != expected:
                raise ValueError(f"{name} must be [num_blocks, block_size, {expected[0]}, {expected[1]}], "
                                 f"got {list(cache.shape)}")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ in shape")
        if (kv_scales is None) != (k_cache.dtype != torch.int8):
            raise ValueError("an int8 KV cache needs its scales (kv_scales), and only an int8 one takes them")
        self.k_cache, self.v_cache, self.kv_scales = k_cache, v_cache, kv_scales
        self.backend = get_backend(k_cache.device, backend)
        self.kv_kwargs = {} if kv_scales is None else {"kv_scales": kv_scales}  # backends without int8 never see it
        self.rotation = None if kv_scales is None else hadamard(self.head_dim, k_cache.device)

    def turned(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k [T, kv_heads, head_dim] times R, in one product (a small one costs its call
        more than its arithmetic); as they are without an int8 cache."""
        if self.rotation is None:
            return q, k
        if self.rotation.dtype != q.dtype:
            self.rotation = self.rotation.to(q.dtype)
        both = torch.matmul(torch.cat([q, k], dim=1), self.rotation)
        return both[:, :q.shape[1]], both[:, q.shape[1]:]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] → [T, num_heads, head_dim]."""
        if self.k_cache is None:
            raise RuntimeError("no KV cache bound: call model.bind_kv_cache(k_caches, v_caches) before forward")
        q, k = self.turned(q, k)
        if self.sliding_window is None:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, md.slot_mapping, **self.kv_kwargs)
            return self.backend.paged_attention(q, self.k_cache, self.v_cache, md, self.scale, **self.kv_kwargs)
        if md.local is not None:  # this layer's KV lives in the engine's local group, through its own block tables
            md = md.local
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, md.slot_mapping, **self.kv_kwargs)
        return self.backend.paged_attention(q, self.k_cache, self.v_cache, md, self.scale, self.sliding_window,
                                            **self.kv_kwargs)


def hadamard(size: int, device: torch.device) -> torch.Tensor:
    """An orthonormal Hadamard matrix of `size` (fp32): Sylvester's construction in blocks of the largest power of two
    dividing `size`, down the diagonal (any head_dim)."""
    block = size & -size
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / block ** 0.5] * (size // block)).to(device)
