"""`batchgen plan`'s screen: one section per line group, figures with the arithmetic behind them."""
from __future__ import annotations

from batchgen.models.hub import parse_hub_id
from batchgen.models.named import NAMED_MODELS
from batchgen.models.registry import GENERIC, SUPPORTED_ARCHITECTURES

from .encoder_plan import EncoderPlan, format_encoder_plan
from .estimate import MEMORY_WARN_SHARE, Plan, percentile, seqs_at_once
from ..input.files import read_columns

WIDTH = 118  # a prompt is shown on one line, its middle elided beyond this


def format_plan(plan: Plan | EncoderPlan, job_path: str) -> str:
    if isinstance(plan, EncoderPlan):
        return format_encoder_plan(plan, job_path)
    sections = [("job", _job(plan)), ("input", _input(plan)), ("prompts", _prompts(plan)),
                ("tokens", _tokens(plan)), ("fit", _fit(plan)), ("memory", _memory(plan)), ("time", _time(plan)),
                ("cost", _cost(plan)), ("output", [f"{plan.config.output.path}: {plan.output_state}"])]
    loaded = "weights loaded only for the time probe" if plan.time.probed else "no weights loaded"
    lines = [f"batchgen plan: {job_path} ({loaded}, nothing written)"]
    for name, body in sections:
        lines.append(f"{name:<8} {body[0]}")
        lines += [f"  {line}" for line in body[1:]]
    return "\n".join(lines)


def _job(plan: Plan) -> list[str]:
    c, e = plan.config, plan.config.engine
    where = "" if plan.model_ref in NAMED_MODELS else f" ({plan.model_dir})"
    model = plan.model_ref if parse_hub_id(c.model) else c.model  # a hub id with the commit it resolved to
    task = "" if c.task == "generate" else f"task {c.task}, "
    return [f"valid: {task}model {model}{where}, {plan.dtype.name} on {plan.device.type} ({plan.dtype.reason}); sort {c.input.sort} "
            f"(window {c.input.sort_window:,}), max_num_seqs {e.max_num_seqs}, max_num_batched_tokens "
            f"{e.max_num_batched_tokens:,}, block_size {e.block_size}, prefix cache "
            f"{'on' if e.enable_prefix_caching else 'off'}, batch-invariant {'on' if e.batch_invariant else 'off'}",
            model_path_line(plan.shape), *_lora(plan), *_speculative(plan)]


def _speculative(plan: Plan) -> list[str]:
    """Speculative decoding: the proposer, and whether this job's batch lets it run (its acceptance: time)."""
    spec = plan.config.engine.speculative
    if spec is None:
        return []
    how = f"prompt lookup ({spec.min_match}..{spec.max_match}-gram)" if spec.method == "ngram" else \
        f"draft model {spec.model}"
    rows = min(plan.config.engine.max_num_seqs, plan.rows_left or plan.inputs.total_rows)
    when = f"on throughout (at most {rows:,} sequences at once)" if rows <= spec.max_batch else \
        f"off while more than {spec.max_batch} sequences decode (this job's batch: up to {rows:,}), on as it thins"
    pays = "it pays where outputs copy the prompt (extraction, rewriting) at small batches: 1.7-2.1x at 1 sequence, " \
        "1.3-1.5x at 8, ~1.0x from 64 on a 2-core AMX CPU, and ~1.0x on free text (docs/performance.md, issue 43)"
    return [f"speculative: {how}, up to {spec.num_tokens} guessed tokens a step and sequence; {when}; {pays}; greedy "
            f"and seeded outputs unchanged"]


def _lora(plan: Plan) -> list[str]:
    """The job's adapters: how many, which rows take which, how many the model holds at once."""
    if not plan.adapters:
        return []
    c = plan.config
    resident = min(c.engine.max_loras, len(plan.adapters))
    rows = f"each row's from column {c.input.lora_column!r}" if c.input.lora_column in plan.inputs.column_types \
        else "no lora column in the input"
    default = f"lora_default {c.lora_default}" if c.lora_default else "the base model by default"
    more = "" if resident == len(plan.adapters) else ", the others read in on demand (least recently used out)"
    return [f"lora: {len(plan.adapters)} adapters ({', '.join(plan.adapters)}); {rows}, {default}; "
            f"{resident} resident at once (engine.max_loras {c.engine.max_loras}){more}"]


def model_path_line(shape) -> str:
    """Which implementation runs the model, and what that costs (docs/models.md)."""
    if shape.path == GENERIC:
        why = "model_impl: transformers" if shape.architecture in SUPPORTED_ARCHITECTURES else "no native one"
        return (f"path: generic ({why}): transformers' {shape.architecture} code on batchgen's engine and paged "
                f"attention; slower than a native path (docs/models.md#the-generic-path)")
    return f"path: native: batchgen's own {shape.architecture} (fused kernels, packed linear layers)"


def _input(plan: Plan) -> list[str]:
    inputs = plan.inputs
    files = f"{len(inputs.files)} file{'s' if len(inputs.files) > 1 else ''}"
    read = set(read_columns(plan.config, inputs.column_types))
    columns = ", ".join(f"{name} {dtype}{'*' if name in read else ''}" for name, dtype in inputs.column_types.items())
    return [f"{plan.config.input.path}: {files}, {inputs.total_rows:,} rows", f"columns: {columns} (* read by the job)"]


def _prompts(plan: Plan) -> list[str]:
    cfg = plan.config.input
    how = ("the job's chat template" if isinstance(cfg.chat_template, str) else "chat template") \
        if cfg.chat_template else "raw text (no chat template)"
    source = "template" if cfg.template else f"column {cfg.messages_column or cfg.prompt_column!r}"
    system = " + system prompt" if cfg.system_prompt else f" + system column {cfg.system_column!r}" \
        if cfg.system_column else ""
    lines = [f"{source}{system} -> {how}; the first {len(plan.tokens.examples)}, as the model gets them:"]
    for row, text in plan.tokens.examples:
        head = f"row {row.row} (id {row.id!r}, {len(row.token_ids)} tokens): "
        lines.append(head + _one_line(text, WIDTH - len(head)))
    return lines


def _one_line(text: str, width: int) -> str:
    shown = repr(text)
    if len(shown) <= width:
        return shown
    head = width // 4  # the end shows the row's own text; the head, the template's start
    return shown[:head] + " ... " + shown[-(width - head - 5):]


def _tokens(plan: Plan) -> list[str]:
    t, total = plan.tokens, plan.inputs.total_rows
    n = len(t.prompt)
    errors = f"{len(t.errors)} row errors"
    if t.errors:
        errors += f" (first: row {t.errors[0].row}: {t.errors[0].error})"
    share = t.shared / sum(t.prompt) if t.prompt else 0.0
    cache = "" if plan.config.engine.enable_prefix_caching else " (prefix caching is off: none is served)"
    generates = plan.config.task == "generate"
    output = (f"output tokens: at most {t.output_bound:,} (n x max_tokens a row; a choice row: its candidates' tokens)"
              + (f"; ~{t.output_bound * total / t.sampled:,.0f} for all {total:,} rows" if t.sampled < total else "")
              if generates else f"output tokens: none (task {plan.config.task}: each prompt runs once)")
    verb = "generate" if generates else "run"
    return [f"the first {t.sampled:,} of {total:,} rows (--sample-rows): {n:,} to {verb}, {errors}",
            f"prompt tokens: p50 {percentile(t.prompt, .5):,}, p90 {percentile(t.prompt, .9):,}, "
            f"max {t.prompt[-1] if n else 0:,} ({sum(t.prompt):,} in the sample)",
            f"shared prefix: {share:.1%} of prompt tokens lie in full {plan.config.engine.block_size}-token blocks "
            f"that an earlier row shares after the {plan.config.input.sort} sort{cache}", output]


def _fit(plan: Plan) -> list[str]:
    t, pool = plan.tokens, plan.kv_pool.tokens
    if not t.longest:
        return ["no row to generate in the sample"]
    longest = t.longest[-1]
    too_long = sum(n > plan.context for n in t.longest)
    if not too_long:
        verdict = "fits"
    elif t.choice_too_long < too_long:
        verdict = "does not fit: such rows stop at the context (finish_reason length)"
    else:
        verdict = "does not fit: such rows are errors (a choice row's prompt and longest candidate must fit)"
    what = "prompt + max_tokens" if plan.config.task == "generate" else "prompt"
    if t.candidates[-1]:  # choice rows: one candidate at a time follows the prompt
        what = "prompt + longest candidate" if t.candidates[0] else f"{what} (a choice row: + its longest candidate)"
    fits, median = seqs_at_once(plan)
    limit = "the KV pool" if fits < plan.config.engine.max_num_seqs else "max_num_seqs"
    return [f"longest {what} {longest:,} vs context {plan.context:,} tokens "
            f"(model {plan.shape.max_model_len:,}, KV pool {pool:,}): {verdict}",
            f"the KV pool holds {fits:,} sequences of the median length ({median:,} tokens) at once; "
            f"max_num_seqs {plan.config.engine.max_num_seqs}: {limit} limits the batch"]


def _memory(plan: Plan) -> list[str]:
    e, w, parts, act = plan.config.engine, plan.weights, plan.memory_parts, plan.activation_parts
    share = plan.peak / plan.available if plan.available else float("inf")
    verdict = "exceeds it" if share > 1 else f"over {MEMORY_WARN_SHARE:.0%}: warning" \
        if share > MEMORY_WARN_SHARE else "ok"
    what = "peak RSS" if plan.device.type == "cpu" else "peak device memory"
    size, kv, layout = plan.dtype.name, plan.kv_pool, plan.engine.kv_layout
    explain = {
        "weights": f"{w.parameters:,} parameters, {'/'.join(w.checkpoint_dtypes)} in {w.files} safetensors "
                   f"file(s) (headers), as {size}" + (", the Linear layers and LM head as int8"
                                                           if e.quantization else ""),
        "mapped": "checkpoint pages resident beside the fused q/k/v and gate/up (or converted) copies",
        "packed": "the matmul weights packed for oneDNN, beside the plain ones while they are packed",
        "kv": f"{plan.kv_blocks:,} of {kv.num_blocks:,} blocks x {e.block_size} tokens x {kv.bytes_per_token:,} B "
              f"(2 x {len(layout.global_layers)} layers x {plan.shape.num_kv_heads} kv heads x {plan.shape.head_dim} "
              f"x {'(int8 + a 4-byte scale)' if plan.engine.kv_dtype is not None else size})"
              + (f" + {plan.kv_local_blocks:,} of {kv.local.num_blocks:,} local blocks x "
                              f"{kv.local.bytes_per_token:,} B ({len(layout.local_layers)} sliding-window layers: "
                              f"only their window's blocks)" if kv.local else "") + f"; the pool from {kv.reason}"
              + ("; resident: the rows' blocks (prompt + max_tokens, less prefix hits"
                 + ("; a choice row: its prompt's and each candidate's own" if plan.tokens.scored else "") + ")"
                 if plan.device.type == "cpu" else ""),
        "activations": f"a {plan.step_tokens:,}-token step {_mib(act['step'])}, logits "
                       f"{_mib(act['logits'])}" + (" (of scored candidates)" if plan.tokens.scored else "")
                       + (f", longest prompt's attention {_mib(act['attention'])}"
                                                   if "attention" in act else ""),
        "released": "the plain matmul weights and checkpoint pages, dropped once packed, before the KV blocks "
                    "and steps take memory: the peak is the larger of loading and running",
        "window": "the sort window's token ids",
        "lora": f"{min(e.max_loras, len(plan.adapters))} LoRA adapter slots, each the largest adapter's weights file",
        "draft": "the speculative draft model's weights and its KV cache over the same blocks",
        "baseline": "this process now: python, torch, transformers, pyarrow, tokenizer, model modules"
                    + (" (it just converted the GGUF: overstated, plan again)" if plan.converted_now else ""),
    }
    names = {"weights": "weights", "mapped": "mapped", "packed": "packed", "kv": "KV pool", "activations": "activations",
             "window": "sort window", "released": "released", "baseline": "baseline", "lora": "lora",
             "draft": "draft model"}
    lines = [f"{what} ~{_mib(plan.peak)} = {share:.0%} of {_mib(plan.available)} {plan.available_source}: "
             f"{verdict} (warn over {MEMORY_WARN_SHARE:.0%}, refuse over 100%)"]
    lines += [f"{names[name]:<12}{_mib(value):>10}  {explain[name]}" for name, value in parts.items() if value]
    return lines


def _time(plan: Plan) -> list[str]:
    t, total = plan.time, plan.inputs.total_rows
    if t.seconds is None:
        return [t.how] + plan.precision
    left = "" if plan.rows_left == total else "; nothing left to generate" if plan.rows_left == 0 else \
        f"; ~{_seconds_left(plan):,.1f} s for the {plan.rows_left:,} rows left"
    if t.probe is not None:
        from .probe import trust_lines
        source = trust_lines(t.probe)
    else:
        source = ["bench records " + ", ".join(t.records)]
    startup = "" if t.startup_s is None else f", + {t.startup_s:.1f} s start-up: ~{t.total_s:,.1f} s in all"
    return [f"~{t.seconds:,.1f} s of generation for all {total:,} rows (+ {t.load_s:.1f} s model load{startup})"
            f"{left}; {t.how}", *source] + plan.precision


def _seconds_left(plan: Plan) -> float:
    return plan.time.seconds * plan.rows_left / plan.inputs.total_rows if plan.inputs.total_rows else 0.0


def _cost(plan: Plan) -> list[str]:
    t = plan.time
    if plan.cost_per_hour is None:
        return ["(give --cost-per-hour USD for cost and tokens per dollar)"]
    if t.seconds is None:
        return ["no time estimate, so no cost"]
    if plan.rows_left == 0:
        return ["nothing left to generate"]
    seconds = _seconds_left(plan) + (t.load_s or 0.0) + (t.startup_s or 0.0)
    dollars = seconds / 3600 * plan.cost_per_hour
    output = plan.tokens.output_bound * plan.rows_left / plan.tokens.sampled
    included = "load included" if t.startup_s is None else "start-up and load included"
    return [f"~${dollars:,.4f} at ${plan.cost_per_hour:,.2f}/h for {seconds:,.1f} s ({included}): "
            f"~{output / dollars:,.0f} output tokens per dollar (at most {output:,.0f} output tokens)"]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"
