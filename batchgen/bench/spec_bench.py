"""`batchgen bench --workload speculative` (issue 43): prompt-lookup speculation off and on, batch size by batch
size, on the same rows, greedy, natural EOS, through the engine's request API.

Two workloads: `extraction` (a passage of 150-300 tokens of the synthetic sentences and an instruction whose answer
copies spans of it: prompt lookup's case) and `generation` (the generation workload's free-text rows, the control).
Each (workload, batch) runs a fresh engine with max_num_seqs = batch, off then on or on then off (alternating), over
the first max(4, 2 x batch) rows (at most --rows); an untimed warm-up request first, load excluded. `on` speculates
in every step (speculative.max_batch = the batch) unless --spec-max-batch sets the engine's rule. Greedy outputs must
be equal: the record counts the rows whose tokens agree."""
from __future__ import annotations

import dataclasses
import gc
import os
import random
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from batchgen.machine import cpu_flags, machine_info

from . import report
from .run_common import BenchResult, git_commit
from .table import _fmt, render_table, short_dtype
from .workloads import (CLAUSES, OBJECTS, SUBJECTS, VERBS, BenchRow, PromptTokenizer, fixed_max_tokens,
                        synthetic_workload)

SPEC_WORKLOADS = ("extraction", "generation")
MODES = ("off", "on")
BRIEF_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
MONTHS = ["January", "March", "April", "June", "August", "October", "November"]
WARM_UP = "Say hello in three words."


@dataclass
class SpecBenchConfig:
    model: str | None = None  # default: the default model
    dtype: str | None = None  # default: the engine's auto
    rows: int = 512  # the most rows one run takes; a run takes max(4, 2 x batch) of them
    seed: int = 0
    max_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16, 32)
    workloads: tuple[str, ...] = SPEC_WORKLOADS
    num_tokens: int = 4  # speculative.num_tokens
    spec_max_batch: int | None = None  # speculative.max_batch of the `on` runs; None: the run's batch (always on)
    kv_cache_memory: str | None = None
    batch_invariant: bool = False  # the engine's batch-invariant kernels, both modes
    out_dir: str = "bench-results"
    archive: str = "docs/performance-archive.jsonl"

    def validate(self) -> None:
        unknown = [name for name in self.workloads if name not in SPEC_WORKLOADS]
        if unknown or not self.workloads:
            raise ValueError(f"--systems for --workload speculative: choose from {', '.join(SPEC_WORKLOADS)}, got "
                             f"{', '.join(unknown) or '(none)'}")
        if self.rows < 1 or self.max_tokens < 1 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("--rows, --max-tokens and every batch size must be at least 1")


def rows_for(batch: int, limit: int) -> int:
    return min(limit, max(4, 2 * batch))


# -- the extraction rows -----------------------------------------------------------------------------------------

def dated_sentence(rng: random.Random) -> str:
    """A workloads.py sentence, some with a date and a count: material for "list the numbers"."""
    text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(CLAUSES)}"
    if rng.random() < 0.5:
        text += f" on {rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(1950, 2024)}, with " \
                f"{rng.randint(3, 400)} people present"
    return text + "."


def extraction_row(rng: random.Random, tokenize: PromptTokenizer, row_id: int, max_tokens: int) -> BenchRow:
    """A passage of 150-300 tokens (prompt) and an instruction whose answer copies spans of it."""
    target = rng.randint(150, 300)
    parts: list[str] = []
    while len(tokenize(" ".join(parts))) < target:
        parts.append(dated_sentence(rng))
    subject = rng.choice([s for s in SUBJECTS if any(p.startswith(s) for p in parts)])
    instruction = rng.choice([
        f"Copy, word for word, every sentence of the passage below that mentions {subject.lower()}.",
        "List the dates and the numbers of people in the passage below, in order, one per line.",
        "List who did what in the passage below, in order: one line per sentence, subject, verb and object.",
        "Rewrite the passage below exactly, fixing nothing."])
    ids = tokenize(f"{instruction}\n\nPassage:\n{' '.join(parts)}")
    return BenchRow(row_id, ids, max_tokens, "extraction")


def build_rows(name: str, count: int, seed: int, tokenizer: Any, max_tokens: int) -> list[BenchRow]:
    if name == "generation":
        return fixed_max_tokens(synthetic_workload("generation", count, seed, tokenizer), max_tokens).rows
    rng, tokenize = random.Random(seed), PromptTokenizer(tokenizer)
    return [extraction_row(rng, tokenize, i, max_tokens) for i in range(count)]


# -- one run -----------------------------------------------------------------------------------------------------

def drain(engine: Any) -> dict[Any, list[int]]:
    tokens = {}
    while engine.has_unfinished():
        for result in engine.step():
            if result.error is not None:
                raise RuntimeError(f"row {result.request_id} failed: {result.error}")
            tokens[result.request_id] = list(result.token_ids)
    return tokens


def run_mode(base: Any, rows: list[BenchRow], batch: int, speculative: dict | None) -> dict[str, Any]:
    """A fresh engine with max_num_seqs `batch` over `rows`; the timed part is the rows' generation only."""
    from batchgen.engine import Engine, Request, SamplingParams

    started = time.monotonic()
    engine = Engine(dataclasses.replace(base, max_num_seqs=batch, speculative=speculative))
    load_s = time.monotonic() - started
    engine.add_request(Request("warm-up", engine.tokenizer.encode(WARM_UP), SamplingParams(max_tokens=8,
                                                                                          temperature=0.0)))
    drain(engine)
    before = engine.stats()
    for row in rows:
        engine.add_request(Request(row.id, row.token_ids, SamplingParams(max_tokens=row.max_tokens, temperature=0.0)))
    started, cpu_started = time.monotonic(), time.process_time()
    tokens = drain(engine)
    wall_s, cpu_s = time.monotonic() - started, time.process_time() - cpu_started
    after = engine.stats()
    del engine
    gc.collect()
    output_tokens = sum(len(ids) for ids in tokens.values())
    steps = after["num_steps"] - before["num_steps"]
    draft = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {"available": True, "reason": None, "dtype": after["dtype"], "load_s": load_s, "wall_s": wall_s,
            "cpu_s": cpu_s, "rows": len(rows), "batch": batch, "output_tokens": output_tokens,
            "output_tok_s": output_tokens / wall_s, "steps": steps, "step_ms": 1000 * wall_s / max(1, steps),
            "spec_draft_tokens": draft, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / draft if draft else None,
            "prefix_cache_hit_rate": None, "tokens": tokens}


def compare(off: dict, on: dict) -> dict[str, Any]:
    same = sum(1 for row_id, ids in off["tokens"].items() if on["tokens"].get(row_id) == ids)
    return {"measure": "output_tok_s", "speedup": on["output_tok_s"] / off["output_tok_s"],
            "step_cost_ratio": on["step_ms"] / off["step_ms"], "rows": len(off["tokens"]), "identical_rows": same,
            "identical_share": same / len(off["tokens"]) if off["tokens"] else None}


# -- the bench ---------------------------------------------------------------------------------------------------

def run_spec_bench(config: SpecBenchConfig, log: Callable[[str], None] = print) -> BenchResult:
    from batchgen.engine import EngineArgs
    from batchgen.engine.speculative.config import DEFAULT_MAX_BATCH

    config.validate()
    started_at = datetime.now(timezone.utc)
    load_before = os.getloadavg()
    overrides = {key: value for key, value in (("dtype", config.dtype), ("kv_cache_memory", config.kv_cache_memory))
                 if value is not None}
    base = EngineArgs(model=config.model or "default", seed=config.seed, batch_invariant=config.batch_invariant,
                      **overrides)
    base.validate()
    tokenizer = None
    systems: dict[str, dict] = {}
    compared: dict[str, dict] = {}
    table_rows: list[dict] = []
    needed = rows_for(max(config.batch_sizes), config.rows)
    run_index = 0
    for workload in config.workloads:
        if tokenizer is None:
            from batchgen.models.loader import load_tokenizer, reference_model_dir
            tokenizer = load_tokenizer(reference_model_dir(base.model))
        rows = build_rows(workload, needed, config.seed, tokenizer, config.max_tokens)
        log(f"bench: {workload}: {needed} rows, prompts of {min(len(r.token_ids) for r in rows)}-"
            f"{max(len(r.token_ids) for r in rows)} tokens, max_tokens {config.max_tokens}")
        for batch in config.batch_sizes:
            chosen = rows[:rows_for(batch, config.rows)]
            spec = {"method": "ngram", "num_tokens": config.num_tokens,
                    "max_batch": config.spec_max_batch or batch}
            runs = {}
            for mode in (MODES if run_index % 2 == 0 else MODES[::-1]):
                runs[mode] = run_mode(base, chosen, batch, spec if mode == "on" else None)
                log(f"bench: {workload} batch {batch} {mode}: {runs[mode]['output_tok_s']:.1f} out tok/s "
                    f"({runs[mode]['wall_s']:.1f} s, {runs[mode]['steps']} steps)")
            run_index += 1
            compared[f"{workload}/b{batch}/on"] = compare(runs["off"], runs["on"])
            for mode, run in runs.items():
                systems[f"{workload}/b{batch}/{mode}"] = {**run, "workload": workload, "mode": mode,
                                                         "speculative": spec if mode == "on" else None}
            table_rows.append({"workload": workload, "batch": batch, "off": runs["off"], "on": runs["on"],
                               "cmp": compared[f"{workload}/b{batch}/on"]})
    present = cpu_flags() or set()
    record = {
        "workload": {"name": "speculative", "model": base.model, "rows": needed, "workloads": list(config.workloads),
                     "max_tokens": config.max_tokens, "notes": ["greedy, natural EOS; a run: max(4, 2 x batch) rows "
                                                                "with max_num_seqs = batch"]},
        "kind": "speculative", "date": started_at.isoformat(), "git_commit": git_commit(), "machine": machine_info(),
        "cpu_flags": [flag for flag in BRIEF_FLAGS if flag in present],
        "load_avg": {"before": list(load_before), "after": list(os.getloadavg())},
        "config": {**dataclasses.asdict(config), "engine_args": dataclasses.asdict(base),
                   "default_max_batch": DEFAULT_MAX_BATCH},
        "systems": {name: {k: v for k, v in run.items() if k != "tokens"} for name, run in systems.items()},
        "comparisons": compared,
        "rows": {name: {str(k): v for k, v in run["tokens"].items()} for name, run in systems.items()},
    }
    stamp = started_at.strftime("%Y%m%d-%H%M%S")
    record_path = Path(config.out_dir) / f"bench-speculative-{stamp}.json"
    archive_path = Path(config.archive)
    report.write_record(record, record_path)
    report.append_archive(record, archive_path)  # without the rows' tokens
    return BenchResult(record, record_path, None, archive_path)


def format_spec_table(record: dict[str, Any]) -> str:
    machine, systems, compared = record["machine"], record["systems"], record["comparisons"]
    header = ["workload", "batch", "rows", "dtype", "out tok", "off tok/s", "on tok/s", "on/off", "accept",
              "tok/step off", "tok/step on", "step on/off", "agree"]
    lines = []
    for name, entry in compared.items():
        workload, batch, _ = name.split("/")
        off, on = systems[f"{workload}/{batch}/off"], systems[name]
        lines.append([workload, batch[1:], str(on["rows"]), short_dtype(on["dtype"]), f"{on['output_tokens']:,}",
                      _fmt(off["output_tok_s"]), _fmt(on["output_tok_s"]), _fmt(entry["speedup"], ".2f", "x"),
                      _fmt(on["spec_acceptance_rate"], ".0%"),
                      _fmt(off["output_tokens"] / max(1, off["steps"]), ".2f"),
                      _fmt(on["output_tokens"] / max(1, on["steps"]), ".2f"),
                      _fmt(entry["step_cost_ratio"], ".2f", "x"),
                      f"{entry['identical_rows']}/{entry['rows']}"])
    load = record["load_avg"]
    title = (f"batchgen bench: speculative (prompt lookup, {record['config']['num_tokens']} tokens), model "
             f"{record['workload']['model']}, max_tokens {record['workload']['max_tokens']} ({record['date'][:19]}, "
             f"{machine['cpu']}, {machine['cores']} cores, {machine['torch_threads']} torch threads; flags "
             f"{', '.join(record['cpu_flags']) or '-'}; load {load['before'][0]:.2f} -> {load['after'][0]:.2f})")
    notes = ["  on/off: output tok/s with speculation over without; accept: guesses that stood; tok/step: output "
             "tokens per engine step (prefill steps included); step on/off: mean step time with over without; agree: "
             "rows whose greedy tokens are equal"]
    return "\n".join([title, render_table(header, lines)] + notes)
