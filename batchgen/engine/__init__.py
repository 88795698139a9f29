"""The engine: continuous batching over a paged KV cache with prefix caching."""
from .engine_args import EngineArgs
from .errors import SettingError
from .request import PoolingParams, Request, Result, SamplingParams

__all__ = ["Engine", "EngineArgs", "PoolingParams", "Request", "Result", "SamplingParams", "SettingError",
           "open_engine"]


def __getattr__(name: str):
    # Engine pulls in torch and transformers: load it only when asked for, so that the job layer can validate a
    # job file (and fail fast) without paying for those imports.
    if name == "Engine":
        from .engine import Engine
        return Engine
    if name == "open_engine":  # Engine, or EncoderEngine for an encoder model (BERT family): one public API
        from .open import open_engine
        return open_engine
    raise AttributeError(name)
