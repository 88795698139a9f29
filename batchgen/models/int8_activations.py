"""W8A8's activations on the CPU (`quantization: int8`): how each token's activations become int8, and the int8 GEMM.

The GEMM is oneDNN's quantized linear (`torch.ops.onednn.qlinear_pointwise`, what x86 inductor lowers quantized
Linears to): the int8 weight reordered once into the kernel's blocked layout (`qlinear_prepack`, at the layer's first
CPU call), int8 activations, the weight's per-channel scales and the activations' scale applied inside the kernel,
bf16/fp32 out. On the 2-core AMX Xeon it multiplies the 1B shape's matrices in 0.33-0.91x bf16's time with a static
scale and 0.38-1.15x with per-token ones (against oneDNN's AMX bf16, PackedLinear, at 1-512 rows), where
`torch._int_mm` plus a separate fp32 rescale took 0.54-1.89x (docs/performance.md, "Issue 43: static and smoothed
activation scales"; dev/microbench_int8.py --gemm-paths).

How the activations are quantized (Int8Linear's `activations`, `input_scale`, `smooth`; calibration.py measures):
- dynamic_int8: one scale per token, its largest |x| / 127; the kernel runs with scale 1 and each output row is
  multiplied by its token's scale after.
- static_int8: one scale per layer, measured on the calibration rows (the largest |x| seen): quantizing is one
  multiply and a round, and the kernel applies the scale.
- smoothed (SmoothQuant, either of the above): the weight's input channel j multiplied by s_j and the activation's
  divided by it (s_j = max|X_j|^a / max|W_j|^(1-a)): outlier channels move into the weight, which has per-channel
  scales. 1/s is folded into the RMSNorm before qkv and gate_up, and into the up rows of gate_up for down_proj
  (fold_smoothing); where nothing precedes it to fold into, the layer multiplies its input by 1/s (`smooth`).
"""
from __future__ import annotations

import torch

_ZERO_POINTS: dict[int, torch.Tensor] = {}  # out features -> the weight's zero points (symmetric: zeros)


def onednn_int8_supported() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def pack(qweight: torch.Tensor) -> torch.Tensor:
    """The int8 weight [out, in] in oneDNN's layout for qlinear_pointwise."""
    return torch.ops.onednn.qlinear_prepack(qweight, None)


def unpack(packed: torch.Tensor, in_features: int, out_features: int) -> torch.Tensor:
    """The plain int8 weight [out, in] back from its packed form: the identity through the kernel (exact)."""
    eye = torch.eye(in_features, dtype=torch.int8)
    ones = torch.ones(out_features)
    out = torch.ops.onednn.qlinear_pointwise(eye, 1.0, 0, packed, ones, _zero_points(out_features), None, 1.0, 0,
                                             torch.float32, "none", [], "")
    return out.round_().to(torch.int8).t().contiguous()


def _zero_points(out_features: int) -> torch.Tensor:
    if out_features not in _ZERO_POINTS:
        _ZERO_POINTS[out_features] = torch.zeros(out_features, dtype=torch.int64)
    return _ZERO_POINTS[out_features]


def quantize_input(x: torch.Tensor, smooth: torch.Tensor | None, input_scale: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor | float]:
    """(int8 x, its scale: a float for static, [rows, 1] fp32 per token for dynamic). x is not modified."""
    x32 = x.float() if smooth is None else x.float() * smooth
    if input_scale is not None:
        return x32.mul(1.0 / input_scale).round_().clamp_(-127, 127).to(torch.int8), input_scale
    x_scale = x32.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12) / 127.0
    return (x32 / x_scale).round_().to(torch.int8), x_scale  # |x / x_scale| <= 127: no clamp needed


def onednn_int8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, smooth: torch.Tensor | None,
                       input_scale: float | None) -> torch.Tensor:
    """x [rows, in] (any float dtype) @ the packed int8 weight's (q * scale).T, in x's dtype."""
    xq, x_scale = quantize_input(x, smooth, input_scale)
    zero_points = _zero_points(scale.shape[0])
    if input_scale is not None:
        out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.ops.onednn.qlinear_pointwise(xq, input_scale, 0, packed, scale, zero_points, None, 1.0, 0,
                                                 out_dtype, "none", [], "")
        return out.to(x.dtype)
    out = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, packed, scale, zero_points, None, 1.0, 0, torch.float32,
                                             "none", [], "")
    return out.mul_(x_scale).to(x.dtype)


def int_mm_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, smooth: torch.Tensor | None,
                  input_scale: float | None) -> torch.Tensor:
    """The same product through torch._int_mm and an fp32 rescale (where oneDNN's quantized linear is missing)."""
    xq, x_scale = quantize_input(x, smooth, input_scale)
    acc = torch._int_mm(xq, qweight.t())
    # Rescaled in place, one [tokens, out] fp32 fewer at once than a new tensor for each product: a 16-row fp32 job
    # on an 8B model (dev/make_random_gguf.py) peaked at 10,307 MiB instead of 10,499, under its bound (10,460).
    out = acc.float()
    del acc
    return out.mul_(x_scale).mul_(scale).to(x.dtype)


def smoothing_factors(channel_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s [in] for a Linear whose input's largest |x| per channel is `channel_max`, weight [out, in]."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    s = channel_max.float().clamp_min(1e-5).pow(alpha) / w_max.pow(1.0 - alpha)
    return s.clamp_(1e-3, 1e3)


def fold_smoothing(model: torch.nn.Module) -> int:
    """Fold each decoder layer's runtime 1/s (a Linear's `smooth`: Int8Linear's) where something before the layer
    carries it exactly: qkv's and gate_up's into the RMSNorm before them (batchgen's RMSNorm: x * w), down_proj's
    into the up rows of gate_up (an Int8Linear's per-channel scales, a float Linear's rows: silu(gate) * up is
    linear in up). Returns the count folded."""
    from .llama import RMSNorm

    folded = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        pairs = ((getattr(layer, "input_layernorm", None), getattr(attn, "qkv_proj", None)),
                 (getattr(layer, "post_attention_layernorm", None), getattr(mlp, "gate_up_proj", None)))
        for norm, linear in pairs:
            if type(norm) is RMSNorm and getattr(linear, "smooth", None) is not None:
                norm.weight.data = (norm.weight.float() * linear.smooth).to(norm.weight.dtype)
                linear.smooth = None
                folded += 1
        gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        if getattr(down, "smooth", None) is not None and (hasattr(gate_up, "scale") or isinstance(
                gate_up, torch.nn.Linear)) and gate_up.out_features == 2 * down.in_features:
            up = slice(down.in_features, gate_up.out_features)
            rows = gate_up.scale if hasattr(gate_up, "scale") else gate_up.weight.data  # int8: its row scales
            rows[up] = (rows[up].float() * (down.smooth if rows.dim() == 1 else down.smooth[:, None])).to(rows.dtype)
            if gate_up.bias is not None:
                gate_up.bias.data[up] = (gate_up.bias[up].float() * down.smooth).to(gate_up.bias.dtype)
            down.smooth = None
            folded += 1
    return folded
