"""The engine for a model: `Engine` (a decoder: paged KV cache, continuous batching) or `EncoderEngine` (an encoder
of the BERT family, for embed and classify). Both have one public API: add_request, step, abort, has_unfinished,
generate, stats, and the attributes the job layer reads (args, plan, tokenizer, max_model_len)."""
from __future__ import annotations

from .engine_args import EngineArgs


def open_engine(args: EngineArgs):
    args.validate()
    from batchgen.models.encoder_support import is_encoder_model  # owned by the encoder work (issue 41)
    if is_encoder_model(args.model):
        from .encoder_engine import EncoderEngine
        return EncoderEngine(args)
    from .engine import Engine
    return Engine(args)
