"""Any other encoder (MPNet, ModernBERT, DistilBERT, DeBERTa, ...) through transformers' own code: AutoModel for
embed, AutoModelForSequenceClassification for classify, on the step's rows (sorted by length) padded to the longest.

A padded row's numbers depend on its batch's longest row (the padded keys' length reaches the reductions); with
`group_by_length` (engine.batch_invariant) each run of rows of one length is its own call, unpadded, so a row's
numbers depend only on the rows of its own length beside it, which attention keeps apart."""
from __future__ import annotations

from pathlib import Path

import torch

from .bert import length_runs
from .registry import ModelError


class GenericEncoder:
    def __init__(self, model_dir: Path, dtype: torch.dtype, classify: bool, pad_token_id: int,
                 group_by_length: bool = False, device: torch.device = torch.device("cpu")) -> None:
        import transformers

        model_class = transformers.AutoModelForSequenceClassification if classify else transformers.AutoModel
        try:
            self.model = model_class.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        except (OSError, ValueError, KeyError) as exc:
            text = str(exc).strip().splitlines()
            raise ModelError(f"{model_dir}: transformers cannot load it as {model_class.__name__} "
                             f"({type(exc).__name__}{': ' + text[0] if text else ''})") from exc
        self.classify_head = classify
        self.pad_token_id = pad_token_id
        self.group_by_length = group_by_length
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)

    def run(self, rows: list[list[int]]) -> torch.Tensor:
        """The rows' last hidden states, concatenated [tokens, hidden] fp32; with a classification head, its
        logits [rows, labels]."""
        lengths = [len(row) for row in rows]
        if not self.group_by_length:
            return self._call(rows, lengths)
        outs, index = [], 0
        for _, count, _ in length_runs(lengths):
            outs.append(self._call(rows[index:index + count], lengths[index:index + count]))
            index += count
        return torch.cat(outs)

    def _call(self, rows: list[list[int]], lengths: list[int]) -> torch.Tensor:
        longest = max(lengths)
        ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        device = self.model.device
        with torch.inference_mode():
            out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device))
        if self.classify_head:
            return out.logits.float().cpu()
        hidden = out.last_hidden_state
        return torch.cat([hidden[i, :n] for i, n in enumerate(lengths)]).float().cpu()
