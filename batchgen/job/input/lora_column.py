"""The input column that names each row's LoRA adapter (input.lora_column; an OpenAI Batch body's `model`): which
column the source reads, and the check that it holds names."""
from __future__ import annotations

from collections.abc import Container

import pyarrow as pa

from ..config import InputConfig, JobConfig, JobConfigError
from .parquet_read import InputFile
from .arrow_types import is_text


def lora_column(config: JobConfig, column_types: Container[str]) -> str | None:
    """The column that names each row's LoRA adapter: input.lora_column where the job has adapters and the input
    has the column (without it, every row takes lora_default); None otherwise."""
    if config.input.format == "openai-batch":  # a request's body names its adapter as its `model`
        return "model" if config.engine.lora else None
    column = config.input.lora_column
    return column if config.engine.lora and column and column in column_types else None


def check_lora_column(config: JobConfig, schema: pa.Schema, path: InputFile) -> None:
    """A job with adapters: its lora column holds strings (or is all null); a column named other than the default
    must be there."""
    column = config.input.lora_column
    if not config.engine.lora or not column or config.input.format == "openai-batch":
        return
    if column not in schema.names:
        if column != InputConfig.lora_column:
            raise JobConfigError(f"input.lora_column: column {column!r} not found in {path} "
                                 f"(columns: {', '.join(schema.names)})")
        return
    arrow_type = schema.field(column).type
    if not pa.types.is_null(arrow_type) and not is_text(arrow_type):
        raise JobConfigError(f"input.lora_column: column {column!r} is {arrow_type} in {path}; it must hold adapter "
                             f"names (strings)")
