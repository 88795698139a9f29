"""The output's column names alone: a leaf that the job's config (output.keep_columns must not clash with them) and
the column table (schema.py: types, readers, meanings) both import, so that neither knows the other.
tests/test_output_schema.py keeps OUTPUT_COLUMNS equal to the table's names."""

# The internal column of in-progress part files: the row's position in the input (the resume ledger).
ROW_COLUMN = "_row"

# The column that tells a row's samples apart (with n > 1): output rows sort by (ROW_COLUMN, SAMPLE_COLUMN).
SAMPLE_COLUMN = "sample_index"

# The output columns, in the table's order (schema.COLUMNS), the conditional ones included.
OUTPUT_COLUMNS = ("id", SAMPLE_COLUMN, "text", "embedding", "label", "probs", "score", "logprob_sum",
                  "num_scored_tokens", "perplexity", "token_logprobs", "finish_reason", "error", "prompt_tokens",
                  "num_truncated_tokens", "output_tokens", "cached_tokens", "queue_s", "ttft_s", "tpot_s", "e2e_s",
                  "arrival_time", "first_token_time", "finish_time", "num_preemptions", "choice_probs", "logprobs",
                  "top_logprobs", "json", "lora", "replica")
