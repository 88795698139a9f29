"""What follows an encoder's last hidden states, for both encoder paths (bert.py, encoder_generic.py): pooling each
row's tokens into one vector (as sentence-transformers pools: mean over every token, [CLS] and [SEP] included), the
sentence-transformers Dense layers, Matryoshka cutting and normalizing; and a classification head's logits into
probabilities and a label."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from .encoder_support import DenseLayer, EncoderDescription
from .registry import ModelError

_DENSE_FUNCTIONS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": F.relu, "gelu": F.gelu,
                    "sigmoid": torch.sigmoid, "silu": F.silu}


def pool_rows(hidden: torch.Tensor, lengths: list[int], modes: list[str]) -> torch.Tensor:
    """[rows, hidden] fp32: each row's tokens (consecutive in `hidden`, `lengths` long) pooled by its mode."""
    out = torch.empty(len(lengths), hidden.shape[1], dtype=torch.float32)
    start = 0
    for i, (length, mode) in enumerate(zip(lengths, modes)):
        row = hidden[start:start + length].float()
        if mode == "cls":
            out[i] = row[0]
        elif mode == "last":
            out[i] = row[-1]
        elif mode == "max":
            out[i] = row.amax(0)
        elif mode == "mean_sqrt_len":
            out[i] = row.sum(0) / length ** 0.5
        else:
            out[i] = row.sum(0) / length  # sentence-transformers' mean: a sum over the tokens, divided by the count
        start += length
    return out


class DenseStack:
    """The model's sentence-transformers Dense layers, applied in order after the pooling (fp32)."""

    def __init__(self, model_dir: Path, layers: tuple[DenseLayer, ...]) -> None:
        self.layers = []
        for layer in layers:
            weights = _read_dense(Path(model_dir) / layer.path)
            try:
                weight = weights["linear.weight"].float()
                bias = weights["linear.bias"].float() if layer.bias else None
            except KeyError as exc:
                raise ModelError(f"{model_dir / layer.path}: no {exc.args[0]} in its weights") from None
            if tuple(weight.shape) != (layer.out_features, layer.in_features):
                raise ModelError(f"{model_dir / layer.path}: weight shape {list(weight.shape)}, its config says "
                                 f"[{layer.out_features}, {layer.in_features}]")
            self.layers.append((weight, bias, _DENSE_FUNCTIONS[layer.activation]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for weight, bias, activation in self.layers:  # row by row: a row's numbers do not depend on its batch
            x = activation(torch.stack([F.linear(row, weight, bias) for row in x]))
        return x


def _read_dense(folder: Path) -> dict[str, torch.Tensor]:
    if os.path.lexists(folder / "model.safetensors"):
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if os.path.lexists(folder / "pytorch_model.bin"):
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelError(f"{folder} holds no Dense weights (model.safetensors or pytorch_model.bin)")


def finish_embeddings(pooled: torch.Tensor, normalize: list[bool], dimensions: list[int | None]) -> list[list[float]]:
    """Each row cut to its dimensions (Matryoshka: the first N), then L2-normalized where asked."""
    out = []
    for row, norm, dims in zip(pooled, normalize, dimensions):
        if dims is not None:
            row = row[:dims]
        if norm:
            row = F.normalize(row, p=2, dim=0)
        out.append(row.tolist())
    return out


def classification(logits: torch.Tensor,
                   description: EncoderDescription) -> list[tuple[list[float], str, float | None]]:
    """Per row: probabilities (softmax, or sigmoid for a multi-label or one-output head), the most probable
    label's name, and the raw output of a one-output head (else None)."""
    logits = logits.float()
    probs = torch.sigmoid(logits) if description.sigmoid_probs else torch.softmax(logits, dim=-1)
    labels = description.labels()
    out = []
    for row_logits, row_probs in zip(logits, probs):
        best = int(torch.argmax(row_probs))
        score = float(row_logits[0]) if logits.shape[1] == 1 else None
        out.append((row_probs.tolist(), labels[best] if best < len(labels) else f"LABEL_{best}", score))
    return out
