"""What both plans share, a decoder's (estimate.py) and an encoder's (encoder_plan.py): the model's files and
tokenizer, the output's state, the memory verdict."""
from __future__ import annotations

import numpy as np

from batchgen.machine import process_rss

from ..config import JobConfig, JobConfigError
from ..output.resume import check_output, output_errors
from ..prepare import PreparedJob, check_chat_template

# Over this share of the available memory the plan warns; over all of it, it refuses (exit 2).
MEMORY_WARN_SHARE = 0.8
# Why a hub model absent from the HF cache stops the plan: what run would do instead.
PLAN_NO_DOWNLOAD = "batchgen plan downloads nothing (batchgen run would download it)"


def memory_verdict(peak: int, available: int) -> tuple[str | None, str | None]:
    """(the job-level error, the warning) for an estimated peak against the memory available."""
    said = f"the estimated peak ({peak / 2**20:,.0f} MiB) is {peak / available:.0%} of the " \
           f"{available / 2**20:,.0f} MiB available"
    if peak > available:
        return f"memory: {said}; lower engine.kv_cache_memory or engine.max_num_batched_tokens", None
    if peak > MEMORY_WARN_SHARE * available:
        return None, f"memory: {said}: little room for error or for other processes"
    return None, None


def load_model_files(config: JobConfig, model_ref: str):
    """The directory of the model the fingerprint names (a GGUF is converted once, into the cache; a hub model is
    the commit found in the HF cache) and its tokenizer; no weights."""
    from batchgen.models import ModelError
    from batchgen.models.loader import engine_model_dir, load_tokenizer

    before = process_rss()
    try:
        model_dir = engine_model_dir(model_ref, config.task)
        # A conversion loads the whole model in this process: the baseline measured below then overstates a run's.
        converted_now = process_rss() - before > 256 * 2**20
        tokenizer = load_tokenizer(model_dir)
    except ModelError as exc:
        raise JobConfigError(f"model: {exc}") from None
    if tokenizer is None:
        raise JobConfigError(f"model: {model_dir} has no tokenizer; a job needs one to build its prompts")
    check_chat_template(config, tokenizer)
    return model_dir, tokenizer, converted_now


def output_status(job: PreparedJob, overwrite: bool) -> tuple[str, int, list[str]]:
    """What the output directory holds for this job, read only: (description, rows a run would generate, the
    job-level errors run would stop with)."""
    out, total = job.out, job.inputs.total_rows
    try:
        with output_errors(out):
            complete = check_output(out, job.fingerprint, overwrite, job.run_schema)
            done = out.done_rows(total).count(1) if out.run_parts() and not overwrite else 0
    except JobConfigError as exc:
        return f"refused: {exc}", total, [str(exc)]
    message = out.busy_message()
    if message is not None:
        return f"refused: {message}", total, [message]
    if overwrite and (out.names() or out.pending_rewrite() is not None):
        return "--overwrite: run discards what this output holds and starts over", total, []
    if complete is not None:
        return f"complete ({complete.get('rows', 0):,} rows, _SUCCESS): run does nothing (--overwrite runs it " \
               f"again)", 0, []
    if out.pending_rewrite() is not None:
        return "every row committed, final parts half moved: run finishes that without loading the model", 0, []
    if done:
        return f"{done:,} of {total:,} rows committed: run resumes with the other {total - done:,}", total - done, []
    return "nothing yet: run starts with row 0", total, []


def percentile(sorted_values: list[int], q: float) -> int:
    return int(np.percentile(sorted_values, q * 100, method="lower")) if sorted_values else 0
