"""The arithmetic of a decoder's prefill-only tasks (EngineArgs.task embed, classify, score): a request's checks and
truncation, an embedding model's own defaults, the hidden rows a step keeps of a pooled sequence, the classification
head, and each Result's fields.

A pooled sequence (SequenceRole.POOL) keeps, per step, either the fp32 sum of its rows (`mean`: summed over the
chunks of a chunked prefill, restarted by a chunk from position 0, as after a preemption) or its last token's row,
once its last chunk is computed (`last`); with a classification head (task classify) that row goes through the head
in fp32 at once, batched over the step. A scored sequence (task score) is the `choice` machinery's SCORE sequence
without the value of ending after its last token (model_runner._scores)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from batchgen.user_files import MODEL_CONFIG_LIMIT, read_user_text

from .request import POOLINGS, PoolingParams
from .sequence import Sequence

LAST, MEAN = "last", "mean"  # the poolings a decoder runs; `cls` (position 0) is an encoder's


@dataclass(frozen=True)
class Classifier:
    """A sequence-classification checkpoint's head as its config describes it."""

    labels: list[str]  # id2label, in output order
    multi_label: bool  # each output through a sigmoid (multi-label, or one output: a reward model), not a softmax


def classifier_of(model) -> Classifier:
    config = model.config
    num_outputs = model.score.out_features
    id2label = {int(key): str(value) for key, value in (getattr(config, "id2label", None) or {}).items()}
    labels = [id2label.get(index, f"LABEL_{index}") for index in range(num_outputs)]
    multi = getattr(config, "problem_type", None) == "multi_label_classification" or num_outputs == 1
    return Classifier(labels, multi)


@dataclass(frozen=True)
class ModelPooling:
    """An embedding model's own defaults (PoolingParams.pooling and normalize when a request leaves them None): its
    sentence-transformers modules (a Pooling module's mode, a Normalize module), else last and normalized."""

    pooling: str = LAST
    normalize: bool = True


# sentence-transformers Pooling config keys (older files) and mode names (newer ones) -> the poolings a decoder runs
_ST_POOLING_KEYS = {"pooling_mode_lasttoken": LAST, "pooling_mode_mean_tokens": MEAN, "pooling_mode_cls_token": "cls"}
_ST_POOLING_NAMES = {"lasttoken": LAST, "mean_tokens": MEAN, "mean": MEAN, "cls_token": "cls", "cls": "cls"}


def model_pooling(model_dir) -> ModelPooling:
    """The model directory's sentence-transformers defaults (modules.json, its Pooling module's config.json); where
    there are none, or they name a mode a decoder does not run, last and normalized."""
    modules = _read_json(Path(model_dir) / "modules.json")
    if not isinstance(modules, list):
        return ModelPooling()
    kinds = {str(module.get("type", "")).rpartition(".")[2]: module for module in modules if isinstance(module, dict)}
    pooling = LAST
    if "Pooling" in kinds:
        config = _read_json(Path(model_dir) / str(kinds["Pooling"].get("path", "")) / "config.json")
        if isinstance(config, dict):
            modes = [mode for key, mode in _ST_POOLING_KEYS.items() if config.get(key) is True]
            mode = _ST_POOLING_NAMES.get(config.get("pooling_mode")) if "pooling_mode" in config else \
                (modes[0] if len(modes) == 1 else None)
            pooling = mode if mode in (LAST, MEAN) else LAST
    return ModelPooling(pooling, "Normalize" in kinds)


def _read_json(path: Path):
    """The file's JSON value, or None where it is absent or not JSON."""
    if not os.path.lexists(path):
        return None
    try:
        return json.loads(read_user_text(path, MODEL_CONFIG_LIMIT))
    except (OSError, ValueError):
        return None


@dataclass
class PrefillPrompt:
    """A prefill-only request as it runs: its (cut) tokens, or why it cannot run."""

    token_ids: list[int]
    num_truncated: int = 0
    problem: str | None = None


def check_prefill(task: str, params: PoolingParams, ids: list[int], max_model_len: int, context_limit: str,
                  hidden_size: int) -> PrefillPrompt:
    """The prompt the request runs (embed and classify: cut to max_model_len unless `truncate` is false), or its
    problem naming the PoolingParams field. A prefill-only prompt may fill the whole context: nothing is generated."""
    def refused(message: str) -> PrefillPrompt:
        return PrefillPrompt(ids, 0, message)

    if not isinstance(params, PoolingParams):
        return refused(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
    if task == "score":
        start = params.score_from
        if not _is_int(start) or not 1 <= start <= len(ids) - 1:
            return refused(f"score_from must be an integer in [1, {len(ids) - 1}] (the prompt's {len(ids)} tokens: "
                           f"the first scored token's index, after at least one of context), got {start!r}")
        if len(ids) > max_model_len:
            return refused(f"prompt is too long: {len(ids)} tokens, and {context_limit}")
        return PrefillPrompt(list(ids))
    if task == "embed":
        if params.pooling not in (None, *POOLINGS):
            return refused(f"pooling must be one of {', '.join(POOLINGS)}, got {params.pooling!r}")
        if params.pooling == "cls":
            return refused("pooling cls (the first token's state) is an encoder's: a decoder's first token sees "
                           "nothing after it; use last or mean")
        if params.normalize not in (None, True, False):
            return refused(f"normalize must be true, false or null, got {params.normalize!r}")
        if params.dimensions is not None and (not _is_int(params.dimensions)
                                              or not 1 <= params.dimensions <= hidden_size):
            return refused(f"dimensions must be an integer in [1, {hidden_size}] (the model's hidden size), got "
                           f"{params.dimensions!r}")
    if not isinstance(params.truncate, bool):
        return refused(f"truncate must be true or false, got {params.truncate!r}")
    if len(ids) <= max_model_len:
        return PrefillPrompt(list(ids))
    if not params.truncate:
        return refused(f"prompt is too long: {len(ids)} tokens, and {context_limit} (truncate is false)")
    return PrefillPrompt(list(ids[:max_model_len]), len(ids) - max_model_len)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pool_rows(hidden: torch.Tensor, pooled: list[tuple[Sequence, int, int]],
              head: torch.nn.Module | None) -> list[tuple[Sequence, int, torch.Tensor]]:
    """What a step keeps of its POOL sequences: (sequence, first position computed, fp32 vector), from the rows
    `start .. start + n - 1` of `hidden` each computed. A `last` sequence gives its last row once its last token is
    computed, through `head` when given (its logits); a `mean` one the sum of its rows."""
    out, last_rows, last_seqs = [], [], []
    for seq, start, n in pooled:
        if seq.pooling == MEAN:
            out.append((seq, seq.num_computed_tokens, hidden[start:start + n].float().sum(dim=0)))
        elif seq.num_computed_tokens + n == seq.num_tokens:
            last_rows.append(start + n - 1)
            last_seqs.append(seq)
    if last_rows:  # index_select copies: a CUDA graph's output rows are overwritten by its next replay
        rows = hidden.index_select(0, torch.tensor(last_rows, device=hidden.device)).float()
        if head is not None:
            rows = F.linear(rows, head.weight.float(), None if head.bias is None else head.bias.float())
        out.extend((seq, seq.num_tokens - 1, row) for seq, row in zip(last_seqs, rows))
    return out


def embedding(seq: Sequence, params: PoolingParams, defaults: ModelPooling) -> list[float]:
    """The pooled vector: the mean (or last) row, its first `dimensions`, L2-normalized where asked (normalize None:
    the model's default)."""
    vector = seq.pooled.double()
    if seq.pooling == MEAN:
        vector = vector / seq.num_tokens
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize if params.normalize is not None else defaults.normalize:
        vector = vector / vector.norm().clamp(min=1e-12)
    return vector.tolist()


def classification(logits: torch.Tensor, classifier: Classifier) -> dict:
    """probs (softmax, or sigmoid for a multi-label or one-output head), the most probable label, and the raw output
    of a one-output head (a reward model's score)."""
    values = logits.double()
    probs = values.sigmoid() if classifier.multi_label else values.softmax(dim=-1)
    best = int(values.argmax())
    score = float(values[0]) if len(classifier.labels) == 1 else None
    return dict(probs=probs.tolist(), label=classifier.labels[best], score=score)

