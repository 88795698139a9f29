"""An encoder loaded for the encoder engine: the native BERT path (bert.py) or transformers' code
(encoder_generic.py), with the model's sentence-transformers Dense layers, behind one surface: the pooled
embeddings or the classification logits of a step's rows (token id lists, sorted by length)."""
from __future__ import annotations

from pathlib import Path

import torch

from .accounting import weight_bytes
from .bert import load_bert
from .encoder_generic import GenericEncoder
from .encoder_pooling import DenseStack, pool_rows
from .encoder_support import EncoderDescription
from .gguf_cache import read_json

NATIVE, GENERIC = "native", "generic"


def encoder_path(description: EncoderDescription, model_impl: str = "auto") -> str:
    """NATIVE where bert.py runs the model (and engine.model_impl allows it), else GENERIC."""
    return NATIVE if description.native and model_impl != "transformers" else GENERIC


class EncoderModel:
    def __init__(self, model_dir: Path, description: EncoderDescription, dtype: torch.dtype, classify: bool,
                 pad_token_id: int, batch_invariant: bool = False, model_impl: str = "auto",
                 device: torch.device = torch.device("cpu")) -> None:
        self.description = description
        self.classify_head = classify
        self.path = encoder_path(description, model_impl)
        if self.path == NATIVE:
            self.native = load_bert(model_dir, read_json(Path(model_dir) / "config.json"), description, dtype,
                                    classify, device)
            self.vocab_size = self.native.vocab_size
            self.generic = None
        else:
            self.native = None
            self.generic = GenericEncoder(model_dir, dtype, classify, pad_token_id, batch_invariant, device)
            self.vocab_size = self.generic.vocab_size
        self.dense = DenseStack(model_dir, description.dense_layers)
        self.device = device

    @property
    def pads_rows(self) -> bool:
        """A step's cost is its rows x its longest row (padded), not its tokens."""
        return self.path == GENERIC and not self.generic.group_by_length

    def embed(self, rows: list[list[int]], poolings: list[str]) -> torch.Tensor:
        """[rows, embedding dimension] fp32: pooled, through the Dense layers; not cut nor normalized."""
        lengths = [len(row) for row in rows]
        with torch.inference_mode():
            if self.native is not None:  # pooled on the CPU (per row), from wherever the model ran
                hidden = self.native(_flat(rows).to(self.device), lengths).cpu()
            else:
                hidden = self.generic.run(rows)
            return self.dense(pool_rows(hidden, lengths, poolings))

    def logits(self, rows: list[list[int]]) -> torch.Tensor:
        """[rows, labels] fp32: the classification head's outputs."""
        with torch.inference_mode():
            if self.native is None:
                return self.generic.run(rows)
            lengths = [len(row) for row in rows]
            hidden = self.native(_flat(rows).to(self.device), lengths)
            starts = torch.tensor([0, *lengths[:-1]], device=self.device).cumsum(0)
            return self.native.classify(hidden[starts]).cpu()

    def weights_bytes(self) -> int:
        """What the model holds: parameters, buffers, packed weights and the Dense layers."""
        module = self.native if self.native is not None else self.generic.model
        return weight_bytes(module) + sum(w.nbytes + (0 if b is None else b.nbytes) for w, b, _ in self.dense.layers)


def _flat(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([token for row in rows for token in row], dtype=torch.long)
