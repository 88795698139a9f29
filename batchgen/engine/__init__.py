"""The engine: continuous batching over a paged KV cache with prefix caching."""
from .engine_args import EngineArgs
from .errors import SettingError
from .request import Request, Result, SamplingParams

__all__ = ["Engine", "EngineArgs", "Request", "Result", "SamplingParams", "SettingError"]


def __getattr__(name: str):
    # Engine pulls in torch and transformers: load it only when asked for, so that the job layer can validate a
    # job file (and fail fast) without paying for those imports.
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(name)
