"""The input side: which files (files.py), reading their rows in bounded batches (parquet_read.py), building each
row's prompt and request in order (source.py) and the guard against special tokens in data (special_tokens.py)."""
