"""`batchgen plan` for an encoder model (BERT family: task embed or classify), which the encoder engine runs without a
KV cache: the model as models/encoder_support.py describes it (no weight read), the sampled rows as the run's source
builds them (a text longer than the model's maximum length is cut, and counted), and a memory estimate of the weights,
one batch's activations and this process. No time estimate: the bench records and the probe time decoders."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.machine import available_memory, process_rss

from ..config import JobConfig, JobConfigError
from ..input.files import InputFiles
from ..input.rows import SourceRow
from ..input.source import read_source
from ..prepare import PreparedJob
from .common import load_model_files, memory_verdict, output_status, percentile

# The activations of a batch, as memory.py counts a decoder's: 1.5x the live [tokens, hidden] and [tokens,
# intermediate] tensors (the allocator keeps freed chunks), and 2.5 copies of one layer's fp32 attention scores.
ACTIVATION_FACTOR = 1.5
ATTENTION_SCORE_COPIES = 2.5


@dataclass
class EncoderPlan:
    config: JobConfig
    inputs: InputFiles
    model_ref: str
    model_dir: Path
    description: Any  # models.encoder_support.EncoderDescription
    dtype: Any  # cpu_features.DtypeChoice: the dtype and why
    device: Any  # torch.device
    max_length: int
    sampled: int
    lengths: list[int]  # the sampled rows' prompt tokens (before the cut), sorted
    truncated: int  # of them, rows longer than max_length
    errors: list[SourceRow]
    examples: list[tuple[SourceRow, str]]
    memory_parts: dict[str, int]
    available: int
    available_source: str
    output_state: str
    rows_left: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return sum(self.memory_parts.values())


def is_encoder(model_ref: str) -> bool:
    from batchgen.models.encoder_support import is_encoder_model

    try:
        return is_encoder_model(model_ref)
    except (ValueError, OSError):  # a model that cannot be read: the decoder's plan says why
        return False


def make_encoder_plan(config: JobConfig, job: PreparedJob, overwrite: bool, sample_rows: int) -> EncoderPlan:
    from batchgen.models.encoder_support import describe_encoder

    model_ref = job.fingerprint["model"]
    output_state, rows_left, problems = output_status(job, overwrite)
    if config.task not in ("embed", "classify"):
        raise JobConfigError(f"task: {config.task} needs a decoder; {config.model} is an encoder model (BERT family), "
                             f"which runs task embed or classify")
    model_dir, tokenizer, _ = load_model_files(config, model_ref)
    try:
        description = describe_encoder(model_dir)
    except ValueError as exc:
        raise JobConfigError(f"model: {exc}") from None
    if config.task == "classify" and not description.has_classifier:
        raise JobConfigError(f"task: classify needs a classification head (a *ForSequenceClassification checkpoint); "
                             f"{config.model} is {description.architecture}: use task embed")
    target = job.target
    max_length = min(description.max_length, config.engine.max_model_len or description.max_length)
    baseline = process_rss()
    sampled = min(sample_rows, job.inputs.total_rows)
    skip = bytearray(job.inputs.total_rows)
    skip[sampled:] = b"\x01" * (job.inputs.total_rows - sampled)
    rows = list(read_source(config, job.inputs, tokenizer, max_length, skip))
    ok = [row for row in rows if row.error is None]
    lengths = sorted(len(row.token_ids) for row in ok)
    examples = [(row, tokenizer.decode(row.token_ids[:max_length], skip_special_tokens=False))
                for row in sorted(ok, key=lambda row: row.row)[:3]]
    bytes_per = target.dtype.dtype.itemsize
    parts = {"weights": description.parameters * bytes_per,
             "activations": activation_bytes(description, config, min(lengths[-1] if lengths else 1, max_length),
                                             bytes_per),
             "baseline": baseline}
    available, source = available_memory(target.device.type)
    problem, warning = memory_verdict(sum(parts.values()), available)
    return EncoderPlan(config, job.inputs, model_ref, model_dir, description, target.dtype, target.device, max_length,
                       sampled, lengths, sum(n > max_length for n in lengths),
                       sorted((row for row in rows if row.error is not None), key=lambda row: row.row), examples,
                       parts, available, source, output_state, rows_left, problems + ([problem] if problem else []),
                       [warning] if warning else [])


def activation_bytes(d: Any, config: JobConfig, longest: int, bytes_per: int) -> int:
    """One batch at its largest: max_num_batched_tokens tokens (rows padded to the longest), the hidden states and
    the MLP's intermediate of every token, and one layer's attention scores."""
    tokens = min(config.engine.max_num_batched_tokens, config.engine.max_num_seqs * longest)
    rows = max(1, tokens // max(longest, 1))
    hidden = tokens * (4 * d.hidden_size + 2 * d.intermediate_size) * bytes_per * ACTIVATION_FACTOR
    scores = rows * d.num_heads * longest * longest * 4 * ATTENTION_SCORE_COPIES
    return int(hidden + scores)


def format_encoder_plan(plan: EncoderPlan, job_path: str) -> str:
    c, d = plan.config, plan.description
    head = (f"embeddings of {d.embedding_dimension:,} dimensions, {d.pooling} pooling"
            f"{', normalized' if d.normalize else ''} (the model's own; embed: may override)"
            if c.task == "embed" else f"{d.num_labels} labels: {', '.join(d.labels()[:8])}"
            + (" ..." if d.num_labels > 8 else "") + f" ({'sigmoid' if d.sigmoid_probs else 'softmax'})")
    n, total = len(plan.lengths), plan.inputs.total_rows
    errors = f"{len(plan.errors)} row errors" + (f" (first: row {plan.errors[0].row}: {plan.errors[0].error})"
                                                  if plan.errors else "")
    share = plan.peak / plan.available if plan.available else float("inf")
    verdict = "exceeds it" if share > 1 else "ok"
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    sections = [
        ("job", [f"valid: task {c.task}, model {c.model} ({plan.model_dir}), {plan.dtype.name} on "
                 f"{plan.device.type} ({plan.dtype.reason}); sort {c.input.sort} (window {c.input.sort_window:,}), "
                 f"max_num_seqs {c.engine.max_num_seqs}, max_num_batched_tokens {c.engine.max_num_batched_tokens:,}",
                 f"encoder: {d.architecture} ({'native' if d.native else 'transformers code'}), "
                 f"{d.parameters:,} parameters, {d.num_layers} layers, hidden {d.hidden_size:,}, {d.num_heads} heads; "
                 f"no KV cache: each batch of rows runs once, "
                 f"{'packed without padding' if d.native else 'padded to its longest row'}", head]),
        ("input", [f"{c.input.path}: {len(plan.inputs.files)} file(s), {total:,} rows"]),
        ("prompts", [f"the first {len(plan.examples)}, as the model gets them (cut to {plan.max_length} tokens):"]
         + [f"row {row.row} (id {row.id!r}, {len(row.token_ids)} tokens): {text[:100]!r}"
            for row, text in plan.examples]),
        ("tokens", [f"the first {plan.sampled:,} of {total:,} rows (--sample-rows): {n:,} to run, {errors}",
                    f"prompt tokens: p50 {percentile(plan.lengths, .5):,}, p90 {percentile(plan.lengths, .9):,}, "
                    f"max {plan.lengths[-1] if n else 0:,}; maximum length {plan.max_length:,} "
                    f"({d.max_length_source}): {plan.truncated:,} of them longer, "
                    + ("cut to it" if getattr(c.task_section, "truncate", True) else "errors (truncate: false)")]),
        ("memory", [f"peak RSS ~{mib(plan.peak)} = {share:.0%} of {mib(plan.available)} {plan.available_source}: "
                    f"{verdict}"]
         + [f"{name:<12}{mib(value):>10}" for name, value in plan.memory_parts.items()]),
        ("time", ["no time estimate for an encoder (the bench records and the probe time decoders)"]),
        ("output", [f"{c.output.path}: {plan.output_state}"]),
    ]
    lines = [f"batchgen plan: {job_path} (no weights loaded, nothing written)"]
    for name, body in sections:
        lines.append(f"{name:<8} {body[0]}")
        lines += [f"  {line}" for line in body[1:]]
    return "\n".join(lines)
