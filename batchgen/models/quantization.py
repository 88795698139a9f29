"""Int8 weights for the decoder's Linear layers and the LM head (`EngineArgs.quantization: int8`).

Each weight matrix [out, in] becomes int8 with one fp32 scale per output channel (symmetric: w ≈ q * scale,
|q| <= 127). How the matmul runs depends on where:

- CPU, the default: W8A8. Each token's activations are quantized to int8 (one scale per token, or with a calibration
  one static scale per layer, optionally after SmoothQuant's smoothing) and oneDNN's quantized linear multiplies them
  by the prepacked int8 weight, the scales applied in the kernel (int8_activations.py; torch._int_mm where oneDNN
  lacks it). On the 2-core AMX Xeon: 0.33-0.91x bf16's matmul time at the 1B shape with a static scale, where
  _int_mm with a separate rescale took 0.54-1.89x; the 1B shape's labeling rows ran at 1.25x bf16 (docs/performance.md, "Issue 43:
  static and smoothed activation scales"). It costs quality: perplexity +4.5% (dev/quant_quality.py), mostly from the int8 inputs of qkv, gate_up
  and the LM head: the calibration (engine/calibration.py) keeps the worst in the dtype.
- CPU with bf16/fp16 activations and `weight_only` (`quantization: int8-weight-only`): `aten._weight_int8pack_mm`
  (the activations stay in the model's dtype) up to WEIGHT_ONLY_MAX_ROWS rows. It reads half the bytes of bf16
  weights, so it is fastest where a step is bound by reading the weights (few rows), but its time grows with the
  rows; a step of more rows multiplies by the weight converted to bf16 a few MiB at a time (`_weight_only_matmul`:
  the default model's 64-row generation bench 27.9 s, against 52.3-53.1 s with the int8 kernel for every step and
  23.8-24.1 s in plain bf16; `batchgen bench --roofline --quantization` measures decode on a given CPU). With fp32 activations it is 6-35x slower
  than fp32 (no vectorised fp32 kernel): the engine refuses it with dtype float32.
- Other devices: the weight is dequantized to the activations' dtype for each matmul (correct anywhere; it saves
  memory, not time).

The embedding lookup keeps its matrix in the model's dtype; a tied LM head gets its own int8 copy of it.

A GGUF file is converted into int8 weights in this layout (gguf_convert.py: each matrix dequantized alone and
requantized at once, its scales rounded to bf16 so that q * scale is the same weight whether the scales are held
in fp32 or bf16) and loaded without a float copy (gguf_int8.py), whatever the job's quantization:
stored_int8_quantization picks its activations.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .int8_activations import int_mm_matmul, onednn_int8_matmul, onednn_int8_supported, pack, unpack

ACTIVATIONS = ("dynamic_int8", "static_int8", "weight_only")  # static_int8: a calibrated scale (int8_activations.py)
# EngineArgs.quantization -> the activations of its Int8Linears. int8-weight-only needs 16-bit activations:
# _weight_int8pack_mm has no vectorised fp32 kernel (6-35x slower than fp32), so the engine refuses it with fp32.
QUANTIZED_ACTIVATIONS = {"int8": "dynamic_int8", "int8-weight-only": "weight_only"}
WEIGHT_ONLY_DTYPES = (torch.bfloat16, torch.float16)


def stored_int8_quantization(quantization: str | None, dtype: torch.dtype) -> str:
    """The quantization a model stored in int8 (a converted GGUF) runs with: the job's when it sets one, else
    weight-only with bf16/fp16 activations and W8A8 with fp32 ones (weight-only has no fast fp32 kernel)."""
    return quantization or ("int8-weight-only" if dtype in WEIGHT_ONLY_DTYPES else "int8")
# The Linear layers quantize_model replaces: these of every decoder layer, and the LM head.
DECODER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
SCALE_BYTES = 4  # one fp32 scale per output channel
# What a calibrated int8 run keeps in the model's dtype whatever the measurement (engine/calibration.py): the
# attention output projection and the LM head, the layers whose int8 inputs cost the most.
DEFAULT_KEEP = ("self_attn.o_proj", "lm_head")


def is_kept(module_name: str, keep: tuple[str, ...] | None) -> bool:
    """Whether EngineArgs.quantization_keep leaves this Linear in the model's dtype: a full name, or a suffix that
    names one Linear of every layer (self_attn.o_proj)."""
    return bool(keep) and any(module_name == k or module_name.endswith("." + k) for k in keep)


def is_quantized(param_name: str) -> bool:
    """Whether quantize_model turns this parameter (our model's name for it) into int8."""
    if param_name == "lm_head.weight":
        return True
    module, _, leaf = param_name.rpartition(".")
    return leaf == "weight" and module.startswith("model.layers.") and module.endswith(DECODER_LINEARS)


QUANTIZE_CHUNK_BYTES = 16 << 20  # fp32 rows quantized at once: a head's temporaries stay small beside its weight


def quantize_weight(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [out, in] int8, scale [out] in `scale_dtype`) with weight ≈ q * scale.
    The scale is rounded to `scale_dtype` before q is computed from it, so that q * scale is the best the stored
    scale allows. Done a few rows at a time: whole-matrix temporaries were 3x the fp32 weight (1.1 GiB for a 1B
    model's tied head), more than the int8 model's memory bound leaves."""
    w = weight.detach()
    rows = max(1, QUANTIZE_CHUNK_BYTES // (4 * max(1, w.shape[1])))
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=scale_dtype, device=w.device)
    for start in range(0, w.shape[0], rows):
        chunk = w[start:start + rows].float()
        s = (chunk.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
        q[start:start + rows] = torch.round(chunk / s.float()[:, None]).clamp_(-127, 127)
        scale[start:start + rows] = s
    return q, scale


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, for x [..., in] of any float dtype; y has x's dtype."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 activations: str = "dynamic_int8", input_scale: float | None = None,
                 smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        if (activations == "static_int8") != (input_scale is not None):
            raise ValueError("static_int8 activations take an input_scale, and only they do")
        self.activations = activations
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.batch_invariant = False  # weight_only: every row count takes the one-row kernel (_weight_only_matmul)
        self.input_scale = None if input_scale is None else float(input_scale)  # static_int8: x ≈ q * input_scale
        self.register_buffer("smooth", smooth)  # [in] fp32 or None: SmoothQuant's 1/s, multiplied into x first
        self.packed_weight = None  # W8A8 on the CPU: qweight in oneDNN's layout, made at the first call (qweight freed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, activations: str = "dynamic_int8",
                    calibrated: float | list[float] | None = None) -> Int8Linear:
        """`calibrated` (EngineArgs.quantization_scales' entry for the layer, W8A8 only): a number is the static
        input scale, a list SmoothQuant's factors s [in] (the weight's columns multiplied by s before quantizing)."""
        weight, smooth, input_scale = linear.weight, None, None
        if isinstance(calibrated, (int, float)):
            activations, input_scale = "static_int8", float(calibrated)
        elif calibrated is not None:
            s = torch.tensor(calibrated, dtype=torch.float32)
            weight, smooth = weight.detach().float() * s, 1.0 / s
        q, scale = quantize_weight(weight, linear.weight.dtype if activations == "weight_only" else torch.float32)
        return cls(q, scale, linear.bias, activations, input_scale, smooth)

    @classmethod
    def from_int8(cls, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, activations: str,
                  dtype: torch.dtype) -> Int8Linear:
        """Stored int8 weights [out, in] and fp32 scales [out]: the scales kept in the activations' `dtype` for
        weight_only (its kernel's), in fp32 for dynamic_int8."""
        return cls(qweight, scale.to(dtype) if activations == "weight_only" else scale.float(), bias, activations)

    def plain_qweight(self) -> torch.Tensor:
        """The int8 weight [out, in], also once packed (read back from the packed form)."""
        if self.qweight is not None:
            return self.qweight
        return unpack(self.packed_weight, self.in_features, self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer multiplies by, [out, in] (a smoothed layer's: its input divided by s first)."""
        return (self.plain_qweight().float() * self.scale.float()[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x.device.type != "cpu":
            x2 = x2 if self.smooth is None else x2 * self.smooth.to(x2.dtype)
            out = F.linear(x2, self.dequantized(x.dtype))
        elif self.activations == "weight_only":
            out = _weight_only_matmul(x2, self.qweight, self.scale.to(x.dtype), self.batch_invariant)
        else:
            if self.packed_weight is None and onednn_int8_supported():
                self.packed_weight = pack(self.qweight)
                self.qweight = None
            if self.packed_weight is not None:
                out = onednn_int8_matmul(x2, self.packed_weight, self.scale, self.smooth, self.input_scale)
            else:
                out = int_mm_matmul(x2, self.qweight, self.scale, self.smooth, self.input_scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activations={self.activations}" + (", smoothed" if self.smooth is not None else ""))


# _weight_int8pack_mm is a matrix-vector product per row: its time grows with the rows as bf16's matmul's does not
# (the default model's shapes on the 2-core AVX-512 EPYC: 0.8-1.3x bf16's F.linear at 8 rows, 1.6-2.7x at 32, 2.6-4.7x
# at 1,024), so a step of more rows than this multiplies by the weight converted to the activations' dtype instead.
WEIGHT_ONLY_MAX_ROWS = 16
# The converted weight a few MiB at a time: under glibc's largest mmap threshold (engine/host_malloc.py), so each
# step reuses the same heap pages rather than faulting in fresh ones (a 49,152-row head converted whole: 19 ms).
CONVERT_CHUNK_BYTES = 16 << 20


def _weight_only_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                        batch_invariant: bool) -> torch.Tensor:
    """x [rows, in] @ (q * scale).T. Up to WEIGHT_ONLY_MAX_ROWS rows of 16-bit activations (and always with
    `batch_invariant`), the int8 kernel, reading half of a 16-bit weight's bytes; from there, and for fp32
    activations (which the engine runs weight-only only where tests ask it to: the kernel has no fast fp32 path),
    the weight converted to x's dtype (exact: |q| <= 127, one pass into a scratch matrix), one matmul, and each output column scaled,
    which is what a step of many rows (a prefill) is bound by: its multiplications, not its weight bytes."""
    if batch_invariant or (x.shape[0] <= WEIGHT_ONLY_MAX_ROWS and x.dtype != torch.float32):
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), qweight, scale)
    rows = max(1, CONVERT_CHUNK_BYTES // (x.element_size() * qweight.shape[1]))
    if rows >= qweight.shape[0]:
        return F.linear(x, qweight.to(x.dtype)).mul_(scale)
    out = x.new_empty(x.shape[0], qweight.shape[0])
    for start in range(0, qweight.shape[0], rows):
        end = min(start + rows, qweight.shape[0])
        out[:, start:end] = F.linear(x, qweight[start:end].to(x.dtype)).mul_(scale[start:end])
    return out


def weight_only_kernel_rows(model: nn.Module) -> int | None:
    """The most rows a step's Linears run on the int8 weight-only kernel (WEIGHT_ONLY_MAX_ROWS), where the model has
    such layers on 16-bit activations and not batch-invariant: a step of more rows takes the converted weight, a
    jump in its cost (speculative decoding keeps small steps under it). None where no Linear switches."""
    for module in model.modules():
        if isinstance(module, Int8Linear) and module.activations == "weight_only" and not module.batch_invariant \
                and module.scale.dtype in WEIGHT_ONLY_DTYPES:
            return WEIGHT_ONLY_MAX_ROWS
    return None


def keep_stored_int8(model: nn.Module, keep: tuple[str, ...] | None, dtype: torch.dtype) -> None:
    """For a model stored in int8 (a converted GGUF), the Int8Linears EngineArgs.quantization_keep names take the
    model's dtype for their activations: weight-only with bf16/fp16, the weight dequantized to fp32 otherwise
    (weight-only has no fast fp32 kernel). Their weights stay what the conversion stored."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Int8Linear) and is_kept(name, keep):
            if dtype in WEIGHT_ONLY_DTYPES:
                kept = Int8Linear(module.plain_qweight(), module.scale.to(dtype), module.bias, "weight_only")
            else:
                kept = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
                kept.weight = nn.Parameter(module.dequantized(dtype), requires_grad=False)
                kept.bias = module.bias
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, kept)


def quantize_model(model: nn.Module, lm_head: bool = True, activations: str = "dynamic_int8") -> nn.Module:
    """Replace every Linear of the decoder layers (qkv, o, gate_up, down) and, if `lm_head`, the LM head by an
    Int8Linear, in place; the fp32/bf16 matrices they held are released (a tied LM head's is the embedding's,
    which stays). Returns the model."""
    for layer in model.model.layers:
        for path in DECODER_LINEARS:
            owner_name, _, name = path.rpartition(".")
            owner = layer.get_submodule(owner_name)
            setattr(owner, name, Int8Linear.from_linear(getattr(owner, name), activations))
    if lm_head:
        model.lm_head = Int8Linear.from_linear(model.lm_head, activations)
    return model


def apply_to_stored(model: torch.nn.Module, scales: dict) -> None:
    """EngineArgs.quantization_scales on a model stored in int8 (a converted GGUF), whose weights were never float
    here: a static scale is set on its W8A8 layer; smoothing factors requantize its weight times s (two roundings:
    the stored one, and this one)."""
    for name, module in model.named_modules():
        if not isinstance(module, Int8Linear) or module.activations != "dynamic_int8" or name not in scales:
            continue
        if isinstance(scales[name], (int, float)):
            module.activations, module.input_scale = "static_int8", float(scales[name])
            continue
        s = torch.tensor(scales[name], dtype=torch.float32)
        q, scale = quantize_weight(module.dequantized() * s)
        module.qweight, module.packed_weight, module.smooth = q, None, 1.0 / s
        module.scale = scale
