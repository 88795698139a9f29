"""Columns a text input's Parquet copy shares between its readers (text_formats.py, openai_batch.py) and the source."""
import pyarrow as pa

INPUT_ERROR_COLUMN = "_input_error"  # why a line could not be a row (null for the rows that could)
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
