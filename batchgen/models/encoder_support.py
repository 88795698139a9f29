"""Encoder models (the BERT family) for the embed and classify tasks: which models are encoders, and what their
sentence-transformers layout says, read from the JSON files and safetensors headers alone (no weight, no
transformers), so that `batchgen plan` can describe one before it loads.

The layout: modules.json lists the modules in order (Transformer, Pooling, optional Dense layers, Normalize);
1_Pooling/config.json names the pooling; sentence_bert_config.json the maximum length a text is cut to. A plain HF
directory without modules.json pools by mean, unnormalized, cut at the tokenizer's model_max_length capped by the
positions the model has."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from .checkpoint_files import weight_files
from .gguf_cache import read_json
from .encoder_types import is_encoder_config
from .registry import ModelError, UnsupportedModelError
from .safetensors_header import read_safetensors_header

# the model types bert.py runs natively (the rest run on transformers' code: encoder_generic.py)
NATIVE_ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert"})
# sentence-transformers Pooling config keys -> the pooling batchgen names it
_POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                  "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                  "pooling_mode_weightedmean_tokens": "weightedmean"}
POOLINGS_RUN = ("mean", "cls", "last", "max", "mean_sqrt_len")
# a Dense module's activation (sentence-transformers writes the torch class path) -> torch.nn.functional's name
DENSE_ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu", "Sigmoid": "sigmoid",
                     "SiLU": "silu"}
_TOKENIZER_MAX = 1_000_000  # a tokenizer's model_max_length above this is transformers' "no limit" placeholder


def is_encoder_model(model_ref) -> bool:
    """Whether the model `model_ref` names (as the loader finds it) is an encoder. Cheap: config.json only; a GGUF
    file (a decoder's format) is not converted to tell."""
    from .loader import find_model  # deferred: the loader imports the models (and torch)

    path = find_model(model_ref)  # named models, directories, hub ids: as resolve_model finds them
    return path.is_dir() and is_encoder_config(read_json(path / "config.json"))


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module: Linear then activation, after the pooling."""

    path: str  # its folder in the model directory
    in_features: int
    out_features: int
    bias: bool
    activation: str  # DENSE_ACTIVATIONS' values


@dataclass(frozen=True)
class EncoderDescription:
    """An encoder model as the encoder engine runs it."""

    model_type: str
    architecture: str  # config.architectures[0]: BertModel, XLMRobertaForSequenceClassification, ...
    native: bool  # bert.py runs it (else transformers' code, encoder_generic.py)
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_length: int  # a prompt's tokens beyond this are cut (or its request refused, truncate: false)
    max_length_source: str  # where max_length comes from, for messages
    pooling: str  # the model's own: POOLINGS_RUN
    normalize: bool  # a Normalize module follows
    sentence_transformers: bool  # the directory has the sentence-transformers layout (modules.json)
    dense_layers: tuple[DenseLayer, ...]
    has_classifier: bool  # a *ForSequenceClassification checkpoint: the classify task's head
    num_labels: int
    id2label: dict[int, str]
    problem_type: str | None  # single_label_classification, multi_label_classification, regression or None
    parameters: int  # every number the checkpoint's safetensors hold, Dense layers included
    checkpoint_bytes: int

    @property
    def embedding_dimension(self) -> int:
        return self.dense_layers[-1].out_features if self.dense_layers else self.hidden_size

    @property
    def sigmoid_probs(self) -> bool:
        """Probabilities by sigmoid (a multi-label or one-output head), else softmax."""
        return self.problem_type == "multi_label_classification" or self.num_labels == 1

    def labels(self) -> list[str]:
        return [self.id2label.get(i, f"LABEL_{i}") for i in range(self.num_labels)]


def describe_encoder(model_dir: Path) -> EncoderDescription:
    """The encoder in `model_dir`; UnsupportedModelError for a layout it cannot run (a pooling it lacks, a Dense
    activation it does not know), ModelError for a file that cannot be read."""
    model_dir = Path(model_dir)
    config = read_json(model_dir / "config.json")
    if not is_encoder_config(config):
        raise UnsupportedModelError(f"{model_dir} is not an encoder model (model_type {config.get('model_type')!r})")
    architecture = (config.get("architectures") or [_default_architecture(config)])[0]
    modules = _modules(model_dir)
    pooling, normalize, dense = "mean", False, []
    for module in modules:
        kind = str(module.get("type", "")).rpartition(".")[2]
        folder = model_dir / str(module.get("path", ""))
        if kind == "Pooling":
            pooling = _pooling(folder / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind == "Dense":
            dense.append(_dense(folder, str(module.get("path", ""))))
        elif kind not in ("Transformer", "Normalize") and not kind.endswith("Transformer"):
            raise UnsupportedModelError(f"{model_dir}: the sentence-transformers module {module.get('type')!r} "
                                        f"is not supported (Transformer, Pooling, Dense and Normalize are)")
    max_length, source = _max_length(model_dir, config)
    id2label = {int(key): str(value) for key, value in (config.get("id2label") or {}).items()}
    has_classifier = architecture.endswith("ForSequenceClassification")
    num_labels = int(config.get("num_labels") or len(id2label) or 2) if has_classifier else 0
    numel, size = _checkpoint_size(model_dir, dense)
    return EncoderDescription(
        model_type=config["model_type"], architecture=architecture,
        native=config["model_type"] in NATIVE_ENCODER_TYPES and config.get("position_embedding_type",
                                                                          "absolute") == "absolute",
        hidden_size=int(config.get("hidden_size") or config.get("dim") or 0),
        num_layers=int(config.get("num_hidden_layers") or config.get("n_layers") or 0),
        num_heads=int(config.get("num_attention_heads") or config.get("n_heads") or 0),
        intermediate_size=int(config.get("intermediate_size") or config.get("hidden_dim") or 0),
        vocab_size=int(config.get("vocab_size") or 0), max_length=max_length, max_length_source=source,
        pooling=pooling, normalize=normalize, sentence_transformers=bool(modules), dense_layers=tuple(dense),
        has_classifier=has_classifier,
        num_labels=num_labels, id2label=id2label if has_classifier else {}, problem_type=config.get("problem_type"),
        parameters=numel, checkpoint_bytes=size)


def _default_architecture(config: dict) -> str:
    return {"xlm-roberta": "XLMRobertaModel", "modernbert": "ModernBertModel", "mpnet": "MPNetModel",
            "distilbert": "DistilBertModel"}.get(config["model_type"], "AutoModel")


def _modules(model_dir: Path) -> list[dict]:
    path = model_dir / "modules.json"
    if not os.path.lexists(path):
        return []
    from batchgen.user_files import MODEL_CONFIG_LIMIT, read_user_text
    import json

    try:
        modules = json.loads(read_user_text(path, MODEL_CONFIG_LIMIT))
    except ValueError as exc:
        raise ModelError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelError(f"{path} is not a list of modules")
    return sorted(modules, key=lambda m: m.get("idx", 0))


def _pooling(path: Path) -> str:
    config = read_json(path)
    if isinstance(config.get("pooling_mode"), str):  # newer sentence-transformers write the mode by name
        modes = [{"lasttoken": "last", "mean_sqrt_len_tokens": "mean_sqrt_len", "weightedmean": "weightedmean",
                  "mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max"}.get(config["pooling_mode"],
                                                                                       config["pooling_mode"])]
    else:
        modes = [name for key, name in _POOLING_MODES.items() if config.get(key)]
    if len(modes) != 1 or modes[0] not in POOLINGS_RUN:
        raise UnsupportedModelError(f"{path}: pooling {' + '.join(modes) or 'none'} is not supported (one of "
                                    f"{', '.join(POOLINGS_RUN)})")
    return modes[0]


def _dense(folder: Path, path: str) -> DenseLayer:
    config = read_json(folder / "config.json")
    activation = str(config.get("activation_function", "torch.nn.modules.linear.Identity")).rpartition(".")[2]
    if activation not in DENSE_ACTIVATIONS:
        raise UnsupportedModelError(f"{folder}: Dense activation {activation!r} is not supported (one of "
                                    f"{', '.join(DENSE_ACTIVATIONS)})")
    return DenseLayer(path, int(config["in_features"]), int(config["out_features"]), bool(config.get("bias", True)),
                      DENSE_ACTIVATIONS[activation])


def _max_length(model_dir: Path, config: dict) -> tuple[int, str]:
    positions = int(config.get("max_position_embeddings") or 512)
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert", "xlm-roberta-xl", "data2vec-text", "mpnet",
                                    "xmod"):
        positions -= int(config.get("pad_token_id", 1)) + 1  # positions start after padding_idx
    st_config = model_dir / "sentence_bert_config.json"
    if os.path.lexists(st_config):
        value = read_json(st_config).get("max_seq_length")
        if isinstance(value, int) and value > 0:
            return min(value, positions), "sentence_bert_config.json's max_seq_length"
    tokenizer_config = model_dir / "tokenizer_config.json"
    if os.path.lexists(tokenizer_config):
        value = read_json(tokenizer_config).get("model_max_length")
        if isinstance(value, (int, float)) and 0 < value < _TOKENIZER_MAX and value < positions:
            return int(value), "the tokenizer's model_max_length"
    return positions, "the model's position embeddings"


def _checkpoint_size(model_dir: Path, dense: list[DenseLayer]) -> tuple[int, int]:
    numel = size = 0
    files = weight_files(model_dir)
    files += [file for layer in dense for file in sorted((model_dir / layer.path).glob("*.safetensors"))]
    for file in files:
        header = read_safetensors_header(file)
        for entry in header.entries.values():
            numel += math.prod(entry["shape"])
            size += entry["data_offsets"][1] - entry["data_offsets"][0]
    if not files:  # pytorch_model.bin only: its size on disk
        for file in model_dir.glob("pytorch_model*.bin"):
            size += file.stat().st_size
        numel = size // 4
    return numel, size
