"""The output side: the column table (column_names.py, schema.py, json_output.py), the part writer, the output-store
protocol (store.py: the ledger of committed rows, and what the job layer asks of an output) with its two kinds, a
local directory (output_dir.py) and an object-store prefix (object_output.py, lease.py), what an existing output
allows (resume.py) and the crash-safe final rewrite (final_rewrite.py, final_formats.py)."""
