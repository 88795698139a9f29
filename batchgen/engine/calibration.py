"""Calibrating W8A8 (`quantization: int8` with `quantization_calibration`): which Linear layers to keep in the model's
dtype, measured on prompts the caller chooses (job/calibration.py: the job's own rows).

One engine in the model's dtype (no quantization, no prefix cache: every pass computes every token) runs the prompts
once with a hook on each Linear that records its activation range (the largest |x| it saw, the mean of each token's
largest |x|, each input channel's largest |x|), and on the LM head that keeps the next-token logits of each prompt. Then, one Linear at a time,
that layer alone is swapped for its W8A8 Int8Linear and the prompts run again: the layer's sensitivity is the mean
KL divergence (nats) of the next-token distributions from the unquantized ones, and `flips` the share of prompts whose
greedy next token changed. With activations static or smooth (EngineArgs.quantization_calibration), each layer's
scale or smoothing factors come from the ranges first (activation_scales) and the swapped layer uses them: the
sensitivities are those of the variant the run will use. choose_keep keeps quantization.DEFAULT_KEEP and every layer above the threshold.
Smooth without a given alpha tries each of SMOOTH_ALPHAS with every measured layer in W8A8 at once and takes the one
whose next-token distributions move least (choose_alpha): SmoothQuant's alpha is the model's, and a few passes find it.

The engine is driven through its public API (add_request, step); the hooks and the swaps are on its model."""
from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..models.int8_activations import smoothing_factors
from ..models.quantization import DEFAULT_KEEP, Int8Linear, is_kept, is_quantized
from .engine_args import SMOOTH_ALPHAS, EngineArgs
from .request import Request, SamplingParams

logger = logging.getLogger("batchgen")

# A layer whose int8 alone moves the next-token distributions by more than this (mean KL, nats) stays in the dtype.
# On the default model (SmolLM2-135M, bf16) over the labeling workload's rows: docs/performance.md, "Issue 43".
DEFAULT_THRESHOLD = 0.01
IDENTITY_ROWS = 1024  # rows of the identity a float Linear multiplies at once to read its weight back
# A static scale is this quantile of the calibration tokens' largest |x| over 127 (1.0: the largest |x| seen).
# Measured on the default model's labeling job: docs/performance.md, "Issue 43: static and smoothed activation scales".
STATIC_QUANTILE = 1.0


@dataclass
class Measurement:
    sensitivity: dict[str, float] = field(default_factory=dict)  # layer -> mean KL (nats) with it alone in int8
    flips: dict[str, float] = field(default_factory=dict)  # layer -> share of prompts whose greedy token changed
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)  # layer -> (max |x|, mean per-token max)
    channel_max: dict[str, torch.Tensor] = field(default_factory=dict)  # layer -> [in] each input channel's max |x|
    token_max: dict[str, torch.Tensor] = field(default_factory=dict)  # layer -> [tokens] each token's max |x|
    scales: dict[str, float | list[float]] = field(default_factory=dict)  # EngineArgs.quantization_scales
    alpha: float | None = None  # smooth: the alpha the scales were made with
    alpha_kl: dict[float, float] = field(default_factory=dict)  # smooth, alpha searched: alpha -> mean KL (nats)


def calibration_args(args: EngineArgs, prompts: int) -> EngineArgs:
    """The unquantized engine the measurement runs on: the job's dtype and device, no prefix cache."""
    return dataclasses.replace(args, quantization=None, quantization_calibration=None, quantization_keep=None,
                               enable_prefix_caching=False, max_num_seqs=max(1, min(args.max_num_seqs, prompts)))


def quantizable_layers(model: nn.Module) -> list[str]:
    """The Linear layers `quantization: int8` turns into Int8Linear, in model order."""
    return [name for name, _ in model.named_modules() if name and is_quantized(f"{name}.weight")]


def measure(engine, prompts: list[list[int]], layers: list[str] | None = None, activations: str = "dynamic",
            alpha: float | None = None, sensitivities: bool = True) -> Measurement:
    """Ranges, scales (activations static or smooth; smooth's alpha searched when None) and, unless told not to,
    sensitivities of `layers` (default: every quantizable one) of `engine`'s unquantized model."""
    model = engine.model
    layers = quantizable_layers(model) if layers is None else layers
    result = Measurement()
    seen: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    hooks = [model.get_submodule(name).register_forward_pre_hook(_range_hook(seen, name)) for name in layers]
    try:
        reference = _next_token_logits(engine, prompts)
    finally:
        for hook in hooks:
            hook.remove()
    for name, (channels, tokens) in seen.items():
        result.channel_max[name], result.token_max[name] = channels, torch.cat(tokens)
        result.ranges[name] = (float(channels.max()), float(result.token_max[name].mean()))
    reference_logp = F.log_softmax(reference, dim=-1)
    greedy = reference.argmax(dim=-1)
    if activations == "smooth" and alpha is None:
        alpha = choose_alpha(engine, prompts, layers, result, reference_logp)
    result.alpha = alpha if activations == "smooth" else None
    result.scales = activation_scales(model, result, activations, alpha)
    for i, name in enumerate(layers if sensitivities else []):
        original = model.get_submodule(name)
        _swap(model, name, _w8a8(original, result.scales.get(name)))
        try:
            logits = _next_token_logits(engine, prompts)
        finally:
            _swap(model, name, original)
        result.sensitivity[name] = _mean_kl(reference_logp, logits)
        result.flips[name] = float((logits.argmax(dim=-1) != greedy).float().mean())
        logger.info("calibration: %d/%d %s KL %.2e", i + 1, len(layers), name, result.sensitivity[name])
    gc.collect()
    return result


def choose_alpha(engine, prompts: list[list[int]], layers: list[str], found: Measurement,
                 reference_logp: torch.Tensor) -> float:
    """The alpha of SMOOTH_ALPHAS whose W8A8 model (every layer of `layers` smoothed at it) gives the next-token
    distributions nearest the unquantized ones (mean KL); each tried alpha's KL goes to found.alpha_kl."""
    model = engine.model
    originals = {name: model.get_submodule(name) for name in layers}
    for alpha in SMOOTH_ALPHAS:
        scales = activation_scales(model, found, "smooth", alpha)
        try:
            for name, original in originals.items():
                _swap(model, name, _w8a8(original, scales.get(name)))
            found.alpha_kl[alpha] = _mean_kl(reference_logp, _next_token_logits(engine, prompts))
        finally:
            for name, original in originals.items():
                _swap(model, name, original)
        logger.info("calibration: smooth alpha %.2f, every layer in int8: KL %.2e", alpha, found.alpha_kl[alpha])
    return min(found.alpha_kl, key=found.alpha_kl.get)


def _mean_kl(reference_logp: torch.Tensor, logits: torch.Tensor) -> float:
    logp = F.log_softmax(logits, dim=-1)
    return float((reference_logp.exp() * (reference_logp - logp)).sum(dim=-1).mean())


def activation_scales(model: nn.Module, found: Measurement, activations: str, alpha: float
                      ) -> dict[str, float | list[float]]:
    """EngineArgs.quantization_scales for the measured layers: static, each layer's input scale (STATIC_QUANTILE of
    its tokens' largest |x|, / 127); smooth, each layer's SmoothQuant factors (int8_activations.smoothing_factors);
    dynamic, none. Rounded to 5 significant digits, as _calibration.json holds them."""
    if activations == "static":
        return {name: _round(float(torch.quantile(tokens, STATIC_QUANTILE)) / 127.0)
                for name, tokens in found.token_max.items()}
    if activations == "smooth":
        return {name: [_round(v) for v in smoothing_factors(channels, _weight(model.get_submodule(name)), alpha).tolist()]
                for name, channels in found.channel_max.items()}
    return {}


def _round(value: float) -> float:
    return float(f"{value:.5g}")


def choose_keep(sensitivity: dict[str, float], threshold: float) -> list[str]:
    """DEFAULT_KEEP, and the layers (not already kept by it) whose sensitivity is above `threshold`, model order."""
    return list(DEFAULT_KEEP) + [name for name, value in sensitivity.items()
                                 if value > threshold and not is_kept(name, DEFAULT_KEEP)]


def _next_token_logits(engine, prompts: list[list[int]]) -> torch.Tensor:
    """[prompts, vocab] fp32: each prompt's next-token logits, by a hook on the LM head while the engine runs them.
    Prompts go in groups that one step prefills whole (the step's LM head rows are then the group's, in the order
    added); a group whose rows or greedy tokens do not match that order runs again one prompt at a time."""
    rows: list[torch.Tensor] = []
    hook = engine.model.lm_head.register_forward_hook(lambda module, args, out: rows.append(out.detach().float()))
    logits: list[torch.Tensor] = []
    try:
        for group in _groups(prompts, engine.args.max_num_batched_tokens, engine.args.max_num_seqs):
            rows.clear()
            tokens = _run(engine, [prompts[i] for i in group])
            found = torch.cat(rows) if len(rows) == 1 else None
            if found is None or found.shape[0] != len(group) or found.argmax(dim=-1).tolist() != tokens:
                found = []
                for i in group:
                    rows.clear()
                    _run(engine, [prompts[i]])
                    found.append(rows[-1][-1:])
                found = torch.cat(found)
            logits.append(found)
    finally:
        hook.remove()
    return torch.cat(logits)


def _groups(prompts: list[list[int]], budget: int, seqs: int) -> list[list[int]]:
    groups: list[list[int]] = [[]]
    tokens = 0
    for i, ids in enumerate(prompts):
        if groups[-1] and (tokens + len(ids) > budget or len(groups[-1]) >= seqs):
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += len(ids)
    return groups


def _run(engine, prompts: list[list[int]]) -> list[int]:
    """Each prompt's greedy next token, the prompts run together."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(("calibration", i), list(ids), params))
    tokens: dict = {}
    while engine.has_unfinished():
        for result in engine.step():
            tokens[result.request_id] = result.token_ids[0] if result.token_ids else -1
    return [tokens[("calibration", i)] for i in range(len(prompts))]


def _range_hook(seen: dict, name: str):
    """Accumulates (each input channel's max |x| [in], [each token's max |x|] per call) of the layer's input."""
    def hook(module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().float()
        channels, tokens = seen.get(name, (torch.zeros(x.shape[1]), []))
        seen[name] = (torch.maximum(channels, x.amax(dim=0)), tokens + [x.amax(dim=1)])
    return hook


def _weight(module: nn.Module) -> torch.Tensor:
    return module.dequantized() if isinstance(module, Int8Linear) else _as_linear(module).weight


def _w8a8(module: nn.Module, calibrated: float | list[float] | tuple[float, ...] | None = None) -> Int8Linear:
    if isinstance(module, Int8Linear) and not isinstance(calibrated, (list, tuple)):  # stored int8 (a converted GGUF): its
        # own weights, int8 activations too (smoothing requantizes its weight: below)
        activations = "dynamic_int8" if calibrated is None else "static_int8"
        return Int8Linear(module.plain_qweight(), module.scale.float(), module.bias, activations, calibrated)
    if isinstance(module, Int8Linear):
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        linear.weight, linear.bias = nn.Parameter(module.dequantized(), requires_grad=False), module.bias
        return Int8Linear.from_linear(linear, "dynamic_int8", calibrated)
    return Int8Linear.from_linear(_as_linear(module), "dynamic_int8", calibrated)


def _as_linear(module: nn.Module) -> nn.Linear:
    """A plain Linear with `module`'s weight: a packed one (PackedLinear) keeps no plain weight, so it is read back
    by multiplying the identity (exact: each output is one product)."""
    if isinstance(module, nn.Linear):
        return module
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    if weight is None:
        dtype = getattr(module, "dtype", torch.float32)
        eye = torch.eye(module.in_features, dtype=dtype)
        zero_bias = bias.detach() if bias is not None else None
        parts = [module(eye[start:start + IDENTITY_ROWS]) for start in range(0, module.in_features, IDENTITY_ROWS)]
        weight = torch.cat(parts).t()
        if zero_bias is not None:
            weight = weight - zero_bias[:, None]
    linear = nn.Linear(module.in_features, module.out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)
