"""`batchgen plan`: a job's whole pre-flight without loading the model's weights. The checks are run's own
(prepare.py's, without the output lock); the tokenizer loads, the model is built on the meta device, and a
sample of rows goes through the job's source (prompt building, tokenizing, sorting) to measure the prompts.
Nothing is written: the output directory is only read."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.engine.block_pool import hash_block
from batchgen.engine.errors import SettingError
from batchgen.engine.engine_plan import EnginePlan, EngineTarget, plan_engine, resolve_target
from batchgen.engine.kv_pool import KVPoolSize
from batchgen.engine.sliding_window import hit_blocks
from batchgen.machine import available_memory, process_rss
from batchgen.models.inspector import ModelDescription

from . import memory
from ..config import JobConfig, setting_error
from ..input.files import InputFiles
from ..prepare import engine_args_for, inspect_job
from ..input.source import SourceRow, read_source
from .common import (MEMORY_WARN_SHARE, PLAN_NO_DOWNLOAD, load_model_files, memory_verdict,  # noqa: F401
                     output_status, percentile)
from .encoder_plan import is_encoder, make_encoder_plan
from .kv_advice import advise_kv_cache
from .precision_advice import advise_precision
from .throughput import TimeEstimate, estimate_time, machine



@dataclass
class TokenStats:
    """The sampled rows: the first `sampled` of the input, built and sorted as the run would."""

    sampled: int
    errors: list[SourceRow]
    prompt: list[int]  # prompt tokens of the rows that would be generated, sorted
    with_output: list[int]  # each of those rows' prompt + its output bound (its samples share the prompt), sorted
    longest: list[int]  # each row's longest sequence: prompt + max_tokens, a `choice` row's + its longest, sorted
    output_bound: int  # the most tokens they generate: n x max_tokens a row; a `choice` row's candidates scored
    scored: int  # of those, the tokens `choice` candidates compute (each: the last prompt token and its own)
    candidates: list[int]  # each row's `choice` candidates (0 without), sorted
    fork_tokens: int  # the most tokens one candidate computes: the last prompt token and the longest candidate
    choice_too_long: int  # `choice` rows whose prompt + longest candidate exceed the context: error rows
    blocks: int  # KV blocks their sequences take, before prefix-cache hits (see row_tokens)
    shared: int  # prompt tokens in full blocks an earlier row shares (what the prefix cache can serve)
    examples: list[tuple[SourceRow, str]]  # the first rows in input order, with their prompt text
    leading: list[list[int]] = field(default_factory=list)  # the first max_num_seqs rows' prompts in the run's order


@dataclass
class Plan:
    config: JobConfig
    inputs: InputFiles
    model_ref: str
    model_dir: Path
    device: Any  # torch.device
    dtype: Any  # cpu_features.DtypeChoice: the dtype and why
    shape: ModelDescription
    weights: memory.WeightBytes
    kv_pool: KVPoolSize
    kv_blocks: int  # of the pool, the blocks the run makes resident: on the CPU those its rows use (kv_blocks_used)
    kv_local_blocks: int  # the same of the local pool (sliding-window layers; 0 without): as many, and its null block
    context: int
    tokens: TokenStats
    memory_parts: dict[str, int]  # name -> bytes, in the order printed
    step_tokens: int  # the largest step's tokens
    activation_parts: dict[str, int]
    available: int
    available_source: str
    output_state: str
    rows_left: int
    time: TimeEstimate
    cost_per_hour: float | None
    problems: list[str] = field(default_factory=list)  # job-level errors: run would refuse (exit 2)
    warnings: list[str] = field(default_factory=list)
    converted_now: bool = False  # the GGUF conversion ran in this process (the baseline is overstated)
    precision: list[str] = field(default_factory=list)  # precision_advice's lines: the fastest dtype/quantization
    engine: EnginePlan | None = None  # the engine's decisions as a run would make them (engine/engine_plan.py)
    adapters: dict = field(default_factory=dict)  # the job's LoRA adapters found (lora/sources.py LocatedAdapter)

    @property
    def peak(self) -> int:
        return sum(self.memory_parts.values())


def make_plan(config: JobConfig, overwrite: bool = False, sample_rows: int = 1000, cost_per_hour: float | None = None,
              archive: Path = Path("docs/performance-archive.jsonl"), probe: bool = False,
              process_started: float | None = None) -> Plan:
    """Every figure of the plan. `process_started` (the CLI's process start, epoch seconds): a probe then counts
    the process's start-up too (probe.py). Raises JobConfigError for a problem that leaves nothing to plan; the others (the
    output refused, memory short) are in `problems`."""
    from batchgen.models.packed_linear import packing_supported

    # prepare_job's checks, without taking the output (its lock, --overwrite's removal) or downloading a model
    job = inspect_job(config, no_download_because=PLAN_NO_DOWNLOAD)
    inputs, model_ref = job.inputs, job.fingerprint["model"]
    if is_encoder(model_ref):  # the BERT family: no KV cache, its own plan
        return make_encoder_plan(config, job, overwrite, sample_rows)
    output_state, rows_left, problems = output_status(job, overwrite)

    try:  # the engine's own rules: device, dtype and why, the quantization's verdict (engine/engine_plan.py)
        target = resolve_target(config.device, config.dtype, config.engine.quantization)
    except SettingError as exc:
        raise setting_error(exc, "engine") from None
    device, choice, dtype = target.device, target.dtype, target.dtype.dtype
    model_dir, tokenizer, converted_now = load_model_files(config, model_ref)
    shape, weights = memory.inspect_model(model_dir, dtype, device.type == "cpu", config.engine.quantization,
                                           config.engine.model_impl)
    baseline = process_rss()  # what a run holds before its weights: see memory.py
    engine = plan_engine_for(config, shape, weights, target, rows_left)
    pool, context, limit = engine.kv_pool, engine.max_model_len, engine.context_limit
    tokens = sample_tokens(config, inputs, tokenizer, context, limit, sample_rows)
    computed = sum(tokens.prompt) - (tokens.shared if config.engine.enable_prefix_caching else 0)

    step_tokens, activations = largest_step(config, shape, dtype, device, tokens, computed, inputs.total_rows,
                                            context)
    kv_blocks = pool.num_blocks if device.type != "cpu" else kv_blocks_used(
        tokens, config.engine.block_size, inputs.total_rows, pool.num_blocks, config.engine.enable_prefix_caching)
    # Each block the global pool hands out has its local counterpart (never-used ones first, as there).
    kv_local_blocks = 0 if pool.local is None else min(pool.local.num_blocks, kv_blocks + 1)
    local_bytes = 0 if pool.local is None else kv_local_blocks * pool.local.block_bytes
    parts = {"weights": weights.loaded, "mapped": weights.mapped,
             "packed": memory.packed_weight_bytes(shape, dtype)
             if packing_supported(device, dtype) and not config.engine.quantization else 0,
             "kv": kv_blocks * pool.block_bytes + local_bytes, "activations": sum(activations.values()),
             "lora": lora_slot_bytes(job.adapters, config.engine.max_loras),
             "draft": draft_model_bytes(config, dtype, device, kv_blocks)}
    if device.type == "cpu":
        parts["window"] = window_bytes(config, tokens, inputs.total_rows)
        if parts["packed"]:
            parts["released"] = memory.released_after_packing(
                weights, parts["kv"] + parts["activations"] + parts["window"])
        parts["baseline"] = baseline
    available, available_source = available_memory(device.type)
    problem, warning = memory_verdict(sum(parts.values()), available)
    problems += [problem] if problem else []

    scale = inputs.total_rows / tokens.sampled if tokens.sampled else 0.0  # the sample's figures for the whole job
    time = estimate_time(archive, model_ref, machine(device), computed * scale, tokens.output_bound * scale,
                         str(choice.dtype).removeprefix("torch."))
    plan = Plan(config, inputs, model_ref, model_dir, device, choice, shape, weights, pool, kv_blocks,
                kv_local_blocks, context, tokens, parts, step_tokens, activations, available, available_source,
                output_state, rows_left, time, cost_per_hour, problems, [warning] if warning else [], converted_now)
    plan.engine = engine
    plan.adapters = job.adapters
    decode_batch = min(config.engine.max_num_seqs, rows_left or inputs.total_rows, seqs_at_once(plan)[0])
    plan.precision = advise_precision(archive, machine(device), str(choice.dtype).removeprefix("torch."),
                                      config.engine.quantization, max(decode_batch, 1), computed * scale,
                                      tokens.output_bound * scale)
    at_once, context = seqs_at_once(plan)
    plan.precision += advise_kv_cache(archive, machine(device), config.engine.kv_cache_dtype, int(context),
                                      at_once < min(config.engine.max_num_seqs, rows_left or inputs.total_rows))
    if probe and config.task == "generate" and time.seconds is None and not problems and rows_left and tokens.leading:  # measure it (probe.py)
        from .probe import probe_time
        plan.time = probe_time(config, str(model_dir), rows_left, tokens.leading, max(decode_batch, 1),
                               computed * scale, tokens.output_bound * scale, tokens.scored * scale, time.how,
                               process_started)
    return plan


def draft_model_bytes(config: JobConfig, dtype, device, kv_blocks: int) -> int:
    """speculative.method draft: the draft model's weights, and its KV cache over the blocks the pool uses (its cache
    mirrors the global pool's: speculative/draft.py)."""
    spec = config.engine.speculative
    if spec is None or spec.method != "draft":
        return 0
    from batchgen.engine.engine_plan import kv_bytes_per_token
    from batchgen.models import ModelError
    from batchgen.models.loader import engine_model_dir

    try:
        draft_dir = engine_model_dir(spec.model, "generate")
    except ModelError as exc:
        raise JobConfigError(f"engine.speculative.model: {exc}") from None
    shape, weights = memory.inspect_model(draft_dir, dtype, device.type == "cpu")
    return weights.loaded + kv_blocks * config.engine.block_size * kv_bytes_per_token(shape, dtype)


def lora_slot_bytes(adapters: dict, max_loras: int) -> int:
    """The model's adapter slots (lora/attach.py): one per adapter resident at once, each as large as the largest
    adapter's weights file (an upper bound where the file holds fp32 and the run bf16)."""
    if not adapters:
        return 0
    return min(max_loras, len(adapters)) * max(found.nbytes for found in adapters.values())


def plan_engine_for(config: JobConfig, shape: ModelDescription, weights: memory.WeightBytes, target: EngineTarget,
                    rows_left: int) -> EnginePlan:
    """The engine plan (the KV pool, the context) by the engine's own function, for the engine settings a run of
    `rows_left` rows gets (prepare's engine_args_for). On CUDA without a kv_cache_memory the engine profiles a step;
    the plan estimates it instead: the device's free memory less the weights, and the activation estimate."""
    args = engine_args_for(config, rows_left)
    dtype, device = target.dtype.dtype, target.device

    def estimate_cuda() -> tuple[int, int]:  # what the engine measures by profiling a step, estimated
        step = memory.activation_bytes(shape, dtype, args.max_num_batched_tokens,
                                       min(args.max_num_seqs, args.max_num_batched_tokens), 0, on_cpu=False)
        return available_memory(device.type)[0] - weights.loaded, sum(step.values())

    try:
        return plan_engine(args, shape, estimate_cuda, target)
    except SettingError as exc:
        raise setting_error(exc, "engine") from None


def kv_blocks_used(tokens: TokenStats, block_size: int, total_rows: int, pool_blocks: int,
                   prefix_caching: bool) -> int:
    """The blocks the run hands out, at most the pool: each row's prompt + max_tokens in blocks (a `choice` row:
    its PREFIX's and each candidate's own), less the full blocks the prefix cache serves, scaled from the sample to
    all rows. The pool hands out never-used blocks before reusing freed ones, so on the CPU this many become
    resident."""
    blocks = tokens.blocks
    if prefix_caching:
        blocks -= tokens.shared // block_size
    scale = total_rows / tokens.sampled if tokens.sampled else 0.0
    return min(pool_blocks, math.ceil(blocks * scale))


def largest_step(config: JobConfig, shape: ModelDescription, dtype, device, tokens: TokenStats, computed: int,
                 total_rows: int, context: int) -> tuple[int, dict[str, int]]:
    """The largest step's tokens and its activations. No step holds more than max_num_seqs whole prompts, nor, when
    every row was sampled, more than all of the job's prompt tokens to compute, a first output token per row and
    the tokens its `choice` candidates compute. When every row has at least max_num_seqs candidates, a step holds
    one row's prompt or one wave of max_num_seqs candidates (scheduler.py)."""
    args = config.engine
    step_tokens = min(args.max_num_batched_tokens, args.max_num_seqs * context)
    if tokens.sampled == total_rows:
        step_tokens = min(step_tokens, computed + len(tokens.prompt) + tokens.scored)
    longest = tokens.prompt[-1] if tokens.prompt else 0
    if tokens.candidates and tokens.candidates[0] >= args.max_num_seqs:
        step_tokens = min(step_tokens, max(longest, args.max_num_seqs * tokens.fork_tokens))
    step_seqs = min(args.max_num_seqs, step_tokens)
    return step_tokens, memory.activation_bytes(shape, dtype, step_tokens, step_seqs, longest, device.type == "cpu",
                                                scored=tokens.scored > 0)


def window_bytes(config: JobConfig, tokens: TokenStats, total_rows: int) -> int:
    """The token ids of the rows the source holds at once: a sort window, or a record batch without sorting."""
    cfg = config.input
    rows = min(cfg.sort_window if cfg.sort != "none" else cfg.read_batch_rows, total_rows)
    mean_prompt = sum(tokens.prompt) / len(tokens.prompt) if tokens.prompt else 0
    return int(rows * mean_prompt * memory.WINDOW_BYTES_PER_TOKEN)


def sample_tokens(config: JobConfig, inputs: InputFiles, tokenizer, context: int, limit: str,
                  sample_rows: int) -> TokenStats:
    """The first `sample_rows` rows through the job's own source: prompts built, tokenized and sorted."""
    total = inputs.total_rows
    sampled = min(sample_rows, total)
    skip = bytearray(total)  # the resume ledger's form: rows marked done are not read
    skip[sampled:] = b"\x01" * (total - sampled)
    rows = list(read_source(config, inputs, tokenizer, context, skip, context_limit=limit))
    ok = [row for row in rows if row.error is None]
    firsts = sorted(ok, key=lambda row: row.row)[:3]
    examples = [(row, tokenizer.decode(row.token_ids, skip_special_tokens=False)) for row in firsts]
    lengths = CandidateLengths(tokenizer)
    shapes = [row_tokens(len(row.token_ids), row.sampling, lengths, config.engine.block_size, context)
              if config.task == "generate" else prefill_only(len(row.token_ids), config.engine.block_size)
              for row in ok]
    return TokenStats(
        sampled=sampled, errors=sorted((row for row in rows if row.error is not None), key=lambda row: row.row),
        prompt=sorted(len(row.token_ids) for row in ok),
        with_output=sorted(shape.with_output for shape in shapes),
        longest=sorted(shape.longest for shape in shapes),
        output_bound=sum(shape.with_output - shape.prompt for shape in shapes),
        scored=sum(shape.scored for shape in shapes),
        candidates=sorted(shape.candidates for shape in shapes),
        fork_tokens=max((shape.longest - shape.prompt + 1 for shape in shapes if shape.candidates), default=0),
        choice_too_long=sum(1 for shape in shapes if shape.candidates and shape.longest > context),
        blocks=sum(shape.blocks for shape in shapes),
        shared=shared_prefix_tokens([row.token_ids for row in ok], config.engine.block_size),
        examples=examples, leading=[row.token_ids for row in ok[:config.engine.max_num_seqs]])


@dataclass(frozen=True)
class RowTokens:
    """One row's sequences, by the engine's arithmetic (request_group.py)."""

    prompt: int
    with_output: int  # prompt + the most tokens it generates (n x max_tokens) or scores (its candidates)
    longest: int  # its longest sequence
    blocks: int  # the KV blocks its sequences take, before prefix-cache hits
    scored: int  # the tokens its `choice` candidates compute
    candidates: int  # how many (0 without `choice`)


def row_tokens(prompt: int, sampling, candidate_lengths: CandidateLengths, block_size: int,
               context: int) -> RowTokens:
    """A row of n samples: prompt + n x max_tokens (their blocks counted as one sequence's), where a sample's
    max_tokens is at most what the context leaves (all of it without max_tokens). A `choice` row: a
    PREFIX (the prompt but its last token) whose forks each compute the last prompt token and one candidate and
    score its end; a fork shares the PREFIX's full blocks, so its own are the rest: a copy of the PREFIX's partial
    last block and the candidate's."""
    if not sampling.choice:
        each = max(0, context - prompt) if sampling.max_tokens is None else \
            max(0, min(sampling.max_tokens, context - prompt))
        output = sampling.n * each
        return RowTokens(prompt, prompt + output, prompt + each, -(-(prompt + output) // block_size), 0, 0)
    lengths = candidate_lengths(sampling.choice)
    scored = sum(lengths) + len(lengths)
    blocks = sum(-(-(prompt + n) // block_size) for n in lengths)
    if len(lengths) > 1 and prompt > 1:
        blocks += -(-(prompt - 1) // block_size) - len(lengths) * ((prompt - 1) // block_size)
    return RowTokens(prompt, prompt + scored, prompt + max(lengths), blocks, scored, len(lengths))


def prefill_only(prompt: int, block_size: int) -> RowTokens:
    """A row of a task other than generate: its prompt, computed once, nothing generated."""
    return RowTokens(prompt, prompt, prompt, -(-prompt // block_size), 0, 0)


class CandidateLengths:
    """Each `choice` string's token count, tokenized once per distinct choice list (a job's rows mostly share
    one: thousands of labels would otherwise be tokenized again for every sampled row)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.known: dict[tuple[str, ...], list[int]] = {}

    def __call__(self, choice: list[str]) -> list[int]:
        key = tuple(choice)
        if key not in self.known:
            self.known[key] = [len(self.tokenizer.encode(text, add_special_tokens=False)) for text in choice]
        return self.known[key]


def shared_prefix_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Prompt tokens the prefix cache can serve when `prompts` arrive in this order and nothing is evicted: the
    leading full blocks each prompt shares with an earlier one (the engine's rule: a hash chain over full blocks,
    the last token always computed)."""
    seen: set[bytes] = set()
    shared = 0
    for ids in prompts:
        parent, hitting = None, True
        for i in range(len(ids) // block_size):
            block_hash = hash_block(parent, ids[i * block_size:(i + 1) * block_size])
            hitting = hitting and block_hash in seen and (i + 1) * block_size <= len(ids) - 1
            shared += block_size if hitting else 0
            seen.add(block_hash)
            parent = block_hash
    return shared


def seqs_at_once(plan: Plan) -> tuple[int, int]:
    """(sequences of the median prompt + max_tokens length (a `choice` row's: + its longest candidate) the KV pool
    holds at once, that length)."""
    median = percentile(plan.tokens.longest, 0.5)
    block_size, local = plan.config.engine.block_size, plan.kv_pool.local
    blocks = max(math.ceil(median / block_size), 1)
    fits = plan.kv_pool.num_blocks // blocks
    if local is not None:  # a decoding sequence holds its window's blocks and the one its next token goes in
        fits = min(fits, (local.num_blocks - 1) // min(blocks, hit_blocks(local.window, block_size) + 1))
    return fits, median

