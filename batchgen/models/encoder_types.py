"""Which config.json describes an encoder (the BERT family): a leaf the loader's directory check reads too
(encoder_support.py, which finds models through the loader, builds on it)."""
from __future__ import annotations

# config.json model_type of the encoders (bidirectional attention, no generation); a decoder's is never here
ENCODER_MODEL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "modernbert", "distilbert", "electra",
    "albert", "deberta", "deberta-v2", "ernie", "megatron-bert", "mobilebert", "squeezebert", "roformer", "rembert",
    "convbert", "data2vec-text", "xmod", "nezha", "nomic_bert", "new", "jina_bert", "eurobert", "neobert",
})


def is_encoder_config(config: dict) -> bool:
    """Whether config.json (as a dict) describes an encoder: its model_type is one of ENCODER_MODEL_TYPES and it is
    not set up as a decoder."""
    return config.get("model_type") in ENCODER_MODEL_TYPES and not config.get("is_decoder", False) and \
        not config.get("is_encoder_decoder", False)
