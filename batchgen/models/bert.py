"""BERT, RoBERTa, XLM-RoBERTa and CamemBERT encoders, natively, over a flat varlen batch: every row's tokens
concatenated, no padding, through the embeddings, the Linear layers and the MLP; attention per row, bidirectional,
one SDPA call per run of rows of one length (the engine hands rows sorted by length).

A row's numbers do not depend on the rows beside it: the Linear layers are oneDNN-packed with one row computed as
two (packed_linear.py: from 2 rows on a row's bits do not depend on the row count; bf16 on AMX: the AMX Linear's
tiles, whose bits depend neither on the rows nor on the thread count), LayerNorm and GELU are per
token, and attention reads only the row's own keys (an SDPA call's batch of equal-length rows is computed one
(row, head) at a time). The residual stream and the norms stay in fp32; with bf16 the Linear layers, attention and
the MLP's activation compute in bf16 (all-MiniLM-L6-v2's embeddings stay above cosine 0.9999 against
sentence-transformers' fp32: tests/test_encoder_models.py).

Heads for classify: BertForSequenceClassification's pooler (dense + tanh on [CLS]) then classifier;
RobertaForSequenceClassification's head (dense + tanh on <s>, then out_proj)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .encoder_support import EncoderDescription
from .packed_linear import AMX_INVARIANT_ROWS_PREFILL, PackedLinear, packing_supported
from .registry import ModelError, UnsupportedModelError

_PREFIXES = ("bert.", "roberta.", "model.")  # a *ForSequenceClassification checkpoint's base model
_ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class EncoderLinear(nn.Module):
    """A Linear computed in the compute dtype (packed where oneDNN has it): any float dtype in, the compute dtype
    out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        weight = weight.to(dtype).contiguous()
        bias = None if bias is None else bias.to(dtype)
        self.dtype = dtype
        if packing_supported(torch.device("cpu"), dtype) and weight.device.type == "cpu":
            self.linear = PackedLinear(weight, bias)
            self.linear.make_batch_invariant(AMX_INVARIANT_ROWS_PREFILL)  # oneDNN on AMX: an encoder's prefill size
        else:
            self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            self.linear.weight = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                self.linear.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.to(self.dtype))


class BertLayer(nn.Module):
    def __init__(self, weights: dict, prefix: str, config: dict, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        w = lambda name: weights[f"{prefix}{name}"]
        attn = "attention.self."
        self.qkv = EncoderLinear(torch.cat([w(f"{attn}{p}.weight") for p in ("query", "key", "value")]),
                                 torch.cat([w(f"{attn}{p}.bias") for p in ("query", "key", "value")]), dtype)
        self.attn_out = EncoderLinear(w("attention.output.dense.weight"), w("attention.output.dense.bias"), dtype)
        self.up = EncoderLinear(w("intermediate.dense.weight"), w("intermediate.dense.bias"), dtype)
        self.down = EncoderLinear(w("output.dense.weight"), w("output.dense.bias"), dtype)
        eps = float(config.get("layer_norm_eps", 1e-12))
        self.attn_norm = _layer_norm(w("attention.output.LayerNorm.weight"), w("attention.output.LayerNorm.bias"), eps)
        self.out_norm = _layer_norm(w("output.LayerNorm.weight"), w("output.LayerNorm.bias"), eps)
        self.num_heads = num_heads
        self.act = _ACTIVATIONS[config.get("hidden_act", "gelu")]

    def forward(self, x: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
        qkv = self.qkv(x)  # attention and the MLP's activation in the compute dtype, the residual stream fp32
        x = self.attn_norm(x + self.attn_out(attention(qkv, runs, self.num_heads)).float())
        return self.out_norm(x + self.down(self.act(self.up(x))).float())


def attention(qkv: torch.Tensor, runs: list[tuple[int, int, int]], num_heads: int) -> torch.Tensor:
    """Bidirectional attention of each row over its own tokens. `runs`: (first token, rows, length) of each run of
    consecutive rows of one length."""
    tokens, width = qkv.shape[0], qkv.shape[1] // 3
    out = torch.empty(tokens, width, dtype=qkv.dtype, device=qkv.device)
    head_dim = width // num_heads
    for start, rows, length in runs:
        block = qkv[start:start + rows * length].view(rows, length, 3, num_heads, head_dim)
        q, k, v = (block[:, :, i].transpose(1, 2) for i in range(3))  # rows, heads, length, head_dim
        o = F.scaled_dot_product_attention(q, k, v)
        out[start:start + rows * length].view(rows, length, num_heads, head_dim).copy_(o.transpose(1, 2))
    return out


def length_runs(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(first token, rows, length) of each run of consecutive equal lengths."""
    runs, start, i = [], 0, 0
    while i < len(lengths):
        j = i
        while j < len(lengths) and lengths[j] == lengths[i]:
            j += 1
        runs.append((start, j - i, lengths[i]))
        start += (j - i) * lengths[i]
        i = j
    return runs


class BertEncoder(nn.Module):
    """The encoder; `head`: None, "bert" (pooler + classifier) or "roberta" (classification head)."""

    def __init__(self, config: dict, shape: EncoderDescription, weights: dict, dtype: torch.dtype,
                 head: str | None) -> None:
        super().__init__()
        self.roberta = config["model_type"] in _ROBERTA_TYPES
        self.position_offset = int(config.get("pad_token_id", 1)) + 1 if self.roberta else 0
        eps = float(config.get("layer_norm_eps", 1e-12))
        self.register_buffer("word_embeddings", weights["embeddings.word_embeddings.weight"].float())
        self.register_buffer("position_embeddings", weights["embeddings.position_embeddings.weight"].float())
        # every token's type is 0
        self.register_buffer("token_type", weights["embeddings.token_type_embeddings.weight"][0].float().clone())
        self.emb_norm = _layer_norm(weights["embeddings.LayerNorm.weight"], weights["embeddings.LayerNorm.bias"], eps)
        self.layers = nn.ModuleList(BertLayer(weights, f"encoder.layer.{i}.", config, shape.num_heads, dtype)
                                    for i in range(shape.num_layers))
        self.vocab_size = self.word_embeddings.shape[0]
        self.max_positions = self.position_embeddings.shape[0] - self.position_offset
        self.head = head
        if head == "bert":
            self.pooler = EncoderLinear(weights["pooler.dense.weight"], weights["pooler.dense.bias"], dtype)
            self.classifier = EncoderLinear(weights["classifier.weight"], weights["classifier.bias"], dtype)
        elif head == "roberta":
            self.pooler = EncoderLinear(weights["classifier.dense.weight"], weights["classifier.dense.bias"], dtype)
            self.classifier = EncoderLinear(weights["classifier.out_proj.weight"], weights["classifier.out_proj.bias"],
                                            dtype)

    def forward(self, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The last hidden states [tokens, hidden] (fp32) of rows `lengths` long, their tokens `ids` concatenated."""
        positions = torch.cat([torch.arange(n, device=ids.device) for n in lengths]) + self.position_offset
        x = self.emb_norm(self.word_embeddings[ids] + self.position_embeddings[positions] + self.token_type)
        runs = length_runs(lengths)
        for layer in self.layers:
            x = layer(x, runs)
        return x

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """The head's logits [rows, labels] from each row's first token's hidden state ([CLS] / <s>)."""
        return self.classifier(torch.tanh(self.pooler(first_tokens).float())).float()


def _layer_norm(weight: torch.Tensor, bias: torch.Tensor, eps: float) -> nn.LayerNorm:
    norm = nn.LayerNorm(weight.shape[0], eps=eps, device="meta")
    norm.weight = nn.Parameter(weight.float(), requires_grad=False)
    norm.bias = nn.Parameter(bias.float(), requires_grad=False)
    return norm


def load_bert(model_dir: Path, config: dict, shape: EncoderDescription, dtype: torch.dtype, classify: bool,
              device: torch.device = torch.device("cpu")) -> BertEncoder:
    """The native encoder from `model_dir`'s weights (safetensors, else pytorch_model.bin), with its
    classification head when `classify` (ModelError when the checkpoint has none)."""
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(f"{model_dir}: position_embedding_type "
                                    f"{config['position_embedding_type']!r} is not supported natively")
    if config.get("hidden_act", "gelu") not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{model_dir}: hidden_act {config['hidden_act']!r} is not supported natively")
    weights = {name: tensor.to(device) for name, tensor in read_weights(model_dir).items()}
    head = None
    if classify:
        head = "roberta" if "classifier.out_proj.weight" in weights else "bert"
        if not ("classifier.weight" in weights or head == "roberta"):
            raise ModelError(f"{model_dir} has no classification head (classifier weights); task classify needs a "
                             f"*ForSequenceClassification checkpoint")
    try:
        with torch.no_grad():
            return BertEncoder(config, shape, weights, dtype, head).eval()
    except KeyError as exc:
        raise ModelError(f"{model_dir}: the checkpoint lacks the weight {exc.args[0]} its config.json "
                         f"implies") from None


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, its base model's prefix (bert., roberta.) dropped."""
    from .checkpoint_files import weight_files

    files = weight_files(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(str(file)))
    elif os.path.lexists(Path(model_dir) / "pytorch_model.bin"):
        tensors = torch.load(Path(model_dir) / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelError(f"no *.safetensors or pytorch_model.bin weights in {model_dir}")
    out = {}
    for name, tensor in tensors.items():
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        out[name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")] = tensor
    return out
