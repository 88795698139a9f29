"""Pieces the Triton attention kernels share."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels use exp2: exp(x) == exp2(x * LOG2E)


def interpreting() -> bool:
    """Whether TRITON_INTERPRET is on: the kernels, decorated after it was read, run in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def dot_needs_fp32(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bf16 tiles as their raw 16-bit integers (it keeps bf16 as uint16 and its
    tl.dot does not convert), so under TRITON_INTERPRET the kernels widen bf16 operands to fp32 first. The products
    of bf16 values are exact in fp32, so this changes nothing but the instruction on a GPU, where it is never set."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def dot(a, b, WIDEN: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 inputs multiply as IEEE fp32 (no TF32 rounding)."""
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def paged_slots(table, pos, pos_ok, BLOCK_SIZE: tl.constexpr):
    """Where context positions `pos` of one sequence live: (physical block, offset in block), via its block table."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    return block, pos % BLOCK_SIZE


@triton.jit
def load_paged(cache_ptr, block, in_block, kv_head, stride_b, stride_s, stride_h, dims, mask):
    """A [positions, head_dim] tile of one KV head from a paged cache [num_blocks, block_size, heads, head_dim]."""
    return tl.load(cache_ptr + block[:, None] * stride_b + in_block[:, None] * stride_s + kv_head * stride_h
                   + dims[None, :], mask=mask, other=0.0)


@triton.jit
def load_kv_tile(cache_ptr, scale_ptr, block, in_block, kv_head, stride_b, stride_s, stride_h, stride_sb, stride_ss,
                 dims, pos_ok, dim_ok, like, KV_INT8: tl.constexpr):
    """load_paged's tile and, from an int8 cache, the tile in `like`'s dtype (int8 values are exact in bf16, fp16
    and fp32) with its scales [positions] (x ~= int8 x scale); else the scale 1.0, never applied."""
    tile = load_paged(cache_ptr, block, in_block, kv_head, stride_b, stride_s, stride_h, dims,
                      pos_ok[:, None] & dim_ok[None, :])
    scale = 1.0
    if KV_INT8:
        scale = tl.load(scale_ptr + block * stride_sb + in_block * stride_ss + kv_head, mask=pos_ok, other=0.0)
        tile = tile.to(tl.float32).to(like.dtype)  # via fp32: the interpreter casts int8 to bf16 as raw bits
    return tile, scale


@triton.jit
def online_softmax_update(scores, m, l, acc, v, v_scale, WIDEN: tl.constexpr, KV_INT8: tl.constexpr):
    """Fold one tile of (log2-domain) scores and its values into the running max m, sum l and output acc. An int8
    V tile's scales (one per position) weigh the probabilities, after the sum: [rows, N] products instead of
    dequantizing [N, head_dim]."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if KV_INT8:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, WIDEN)
    return m_new, l, acc


@triton.jit
def store_int8(x, dst, scale_dst, mask):
    """Quantize one row x (a token's K or V of one head) as reference.quantize_kv does, bit for bit: scale =
    absmax / 127, the value round-half-even(x x (127 / absmax)) with true divisions. The launch turns FMA fusion off
    (enable_fp_fusion=False): a fused x * inv - floor would round a product's tie differently from torch."""
    x = x.to(tl.float32)
    absmax = tl.max(tl.where(mask, tl.abs(x), 0.0), 0)
    inv = tl.where(absmax > 0, tl.math.div_rn(127.0, tl.where(absmax > 0, absmax, 1.0)), 0.0)
    y = x * inv
    low = tl.floor(y)
    frac = y - low
    odd = low - 2.0 * tl.floor(low * 0.5) != 0.0
    rounded = tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low)
    tl.store(dst, rounded.to(tl.int8), mask=mask)
    tl.store(scale_dst, tl.math.div_rn(absmax, 127.0))


def kv_scale_args(k_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    """The kernels' (K scales, V scales, their block stride, their slot stride, KV_INT8) for an int8 cache; for
    another, the cache in the scales' place (never read)."""
    if kv_scales is None:
        if k_cache.dtype == torch.int8:
            raise ValueError("an int8 KV cache needs its scales (kv_scales)")
        return k_cache, k_cache, 0, 0, False
    k_scale, v_scale = kv_scales
    if k_cache.dtype != torch.int8:
        raise ValueError(f"kv_scales come with an int8 KV cache, not {k_cache.dtype}")
    if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_scale.shape:
        raise ValueError(f"kv_scales must be [num_blocks, block_size, num_kv_heads] = {list(k_cache.shape[:3])}, got "
                         f"{list(k_scale.shape)} and {list(v_scale.shape)}")
    if k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1 or k_scale.dtype != torch.float32:
        raise ValueError("the K and V scales must be fp32, laid out alike, contiguous over kv heads")
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), True


def unpipelined_for_fp32(kv_int8: bool, dtype: torch.dtype) -> dict:
    """Launch options of the attention kernels: over an int8 cache with an fp32 query, no software pipelining. The
    pipelined int8 tiles made the fp32 (IEEE, FMA) decode dot spill 3.6-4 KB of stack per thread on sm_90
    (triton_aot); unpipelined it spills at most tens of bytes, as over an fp32 cache. 16-bit queries keep the
    pipelining: they compile without spills."""
    return {"num_stages": 1} if kv_int8 and dtype == torch.float32 else {}


def triton_error_reason(exc: BaseException) -> str:
    """One line for a Triton failure. A CompilationError's own message is the kernel's source, and the reason (tl.dot's
    "K >= 16") is in the error it was raised from: the innermost message of the chain is the one that says."""
    reason = ""
    while exc is not None:
        reason = getattr(exc, "error_message", None) or str(exc) or reason
        exc = exc.__cause__
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    return lines[0] if lines else ""
