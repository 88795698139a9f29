"""The one error type for an invalid setting, carrying the name of the field it is about."""
from __future__ import annotations


class SettingError(ValueError):
    """An invalid value of one EngineArgs or SamplingParams field. `key` is the field's name ("max_tokens",
    "kv_cache_memory", ...), so that a caller can say where the value came from without parsing the message."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
