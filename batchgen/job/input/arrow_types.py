"""What an input column's Arrow type holds, as the input checks ask it (files.py, lora_column.py)."""
from __future__ import annotations

import pyarrow as pa


def is_text(arrow_type: pa.DataType) -> bool:
    if pa.types.is_dictionary(arrow_type):
        return is_text(arrow_type.value_type)
    return any(is_type(arrow_type) for is_type in (pa.types.is_string, pa.types.is_large_string,
                                                   pa.types.is_string_view, pa.types.is_null))
