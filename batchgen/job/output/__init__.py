"""The output side: the column table (schema.py, json_output.py), the part writer and the ledger of committed rows
(sink.py), what an existing output allows (resume.py) and the crash-safe final rewrite (final_rewrite.py)."""
