"""Tiny random encoders for the encoder tests: transformers' own classes with every parameter random (biases and
norms too), saved with all-MiniLM-L6-v2's BERT tokenizer files (a 30,522-token vocabulary)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from conftest import randomize_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=160)


def save_tiny_encoder(path: Path, model_type: str, architecture: str, minilm_dir: Path, seed: int = 0, **fields):
    """A random `architecture` (e.g. BertForSequenceClassification) of `model_type` saved in `path`; returns the
    transformers model (fp32, eval) as saved."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **fields}, architectures=[architecture])
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    randomize_weights(model, seed, 0.3)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_dir) / name, Path(path) / name)
    return model


def random_rows(count: int, low: int, high: int, seed: int = 0, vocab: int = 30522) -> list[list[int]]:
    """Token id rows framed as the BERT tokenizer frames them ([CLS] ... [SEP]), `low` to `high` tokens long."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        n = int(torch.randint(low, high + 1, (1,), generator=generator))
        rows.append([101, *torch.randint(1000, vocab, (n - 2,), generator=generator).tolist(), 102])
    return rows
