"""Triton kernel that writes a step's new K/V into their paged-cache slots (an int8 cache: quantized as it writes)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import KVScales
from .triton_common import kv_scale_args, store_int8


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_sb, stride_ss,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     KV_INT8: tl.constexpr):
    """One program per (token, KV head)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token (e.g. in a CUDA-graph batch) owns no slot
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    key = tl.load(key_ptr + token * stride_kt + head * stride_kh + dims, mask=dim_ok)
    value = tl.load(value_ptr + token * stride_vt + head * stride_vh + dims, mask=dim_ok)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + dims
    if KV_INT8:
        scale_at = block * stride_sb + offset * stride_ss + head
        store_int8(key, k_dst, k_scale_ptr + scale_at, dim_ok)
        store_int8(value, v_dst, v_scale_ptr + scale_at, dim_ok)
    else:
        tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=dim_ok)
        tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=dim_ok)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """Write the new tokens' K/V ([T, Hkv, D]) into their cache slots; a negative slot means 'skip this token'. An
    int8 cache (with its `kv_scales`) gets each token's K and V quantized per kv head, as reference.store_kv does."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for name, tensor in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    k_scale, v_scale, stride_sb, stride_ss, kv_int8 = kv_scale_args(k_cache, kv_scales)
    _store_kv_kernel[(num_tokens, num_heads)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sb, stride_ss,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        KV_INT8=kv_int8, enable_fp_fusion=not kv_int8)
