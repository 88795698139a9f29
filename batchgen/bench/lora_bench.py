"""`batchgen bench --workload lora` (issue 42): one job over several LoRA adapters against the base model alone and
against the adapters run as merged-model jobs one after the other, on the same rows, greedy, fixed length.

Three systems, one after another in this process, every one on the same base weights (a GGUF's fp32 conversion, as
the other systems of the bench load it; a directory as it is):
- base: every row on the base model (one engine);
- batchgen-lora: the same rows, row i on adapter i mod N, one engine with every adapter (max_loras 4);
- merged-sequential: for each adapter, a model directory with the adapter merged into the base weights
  (W + scale * B @ A, written as safetensors beforehand and not timed) and a fresh engine over that adapter's rows,
  one after the other: each engine's load counts, as four merged-model jobs would pay it.

The issue's bars: batchgen-lora's output tokens/s over base's (generation, >= 0.8x), and its job tokens/s (load +
generation) over merged-sequential's (>= 2x); in fp32 its greedy tokens equal the merged models' (agreement()).
The adapters: 4 random rank-8 ones on q/k/v/o/gate/up/down (random_adapter.py), or `--lora NAME=DIR` repeated."""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from batchgen.machine import cpu_flags, machine_info

from . import report
from .run_common import BenchResult, git_commit, resolved_dtype
from .system_types import BenchOptions, RowOutput, SystemRun, availability, elapsed
from .systems import run_system
from .table import _fmt, render_table, short_dtype
from .workloads import Workload, fixed_max_tokens, synthetic_workload

LORA_SYSTEMS = ("base", "batchgen-lora", "merged-sequential")
REFERENCE = "batchgen-lora"
BARS = {"base": 0.8, "merged-sequential": 2.0}  # batchgen-lora's speed over each, at least
RANDOM_ADAPTERS, RANDOM_RANK = 4, 8
BRIEF_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass
class LoraBenchConfig:
    model: str | None = None  # default: the default model
    rows: int = 256
    seed: int = 0
    max_tokens: int = 64  # every row's, generated exactly (ignore_eos)
    dtype: str | None = None  # default: auto, as the engine resolves it
    adapters: dict[str, str] | None = None  # --lora NAME=DIR; default: RANDOM_ADAPTERS random ones
    systems: tuple[str, ...] = LORA_SYSTEMS
    max_num_seqs: int | None = None
    kv_cache_memory: str | None = None
    out_dir: str = "bench-results"
    archive: str = "docs/performance-archive.jsonl"

    def validate(self) -> None:
        unknown = [name for name in self.systems if name not in LORA_SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"--systems: unknown {', '.join(unknown) or '(none given)'} for --workload lora; "
                             f"choose from {', '.join(LORA_SYSTEMS)}")
        if self.rows < 1 or self.max_tokens < 1:
            raise ValueError(f"--rows and --max-tokens must be at least 1, got {self.rows} and {self.max_tokens}")
        if self.adapters is not None and not self.adapters:
            raise ValueError("--lora: give at least one NAME=DIR")


@dataclass
class LoraSetup:
    workload: Workload
    engine_args: Any  # the base engine's (the base weights' directory, the dtype, ...)
    adapters: dict[str, str]  # name -> directory
    lora_of: dict[int, str]  # row id -> its adapter
    random_adapters: bool
    notes: list[str] = field(default_factory=list)


def parse_lora_options(values: tuple[str, ...]) -> dict[str, str] | None:
    """`--lora NAME=DIR` options as a map; None when none was given."""
    adapters = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora must be NAME=DIR, got {value!r}")
        adapters[name.strip()] = path.strip()
    return adapters or None


def build_setup(config: LoraBenchConfig, scratch: Path) -> LoraSetup:
    from batchgen.engine import EngineArgs
    from batchgen.models.loader import load_tokenizer, reference_model_dir

    from batchgen.lora.random_adapter import write_adapter

    model = config.model or "default"
    base_dir = reference_model_dir(model)  # a GGUF's fp32 conversion: what a merged model is made from
    overrides = {key: value for key, value in (("max_num_seqs", config.max_num_seqs),
                                               ("kv_cache_memory", config.kv_cache_memory)) if value is not None}
    engine_args = EngineArgs(model=str(base_dir), **overrides)
    engine_args.validate()
    engine_args = dataclasses.replace(engine_args, dtype=resolved_dtype(config.dtype or "auto", engine_args.device))
    workload = synthetic_workload("generation", config.rows, config.seed, load_tokenizer(base_dir), model)
    workload = fixed_max_tokens(workload, config.max_tokens)
    workload = Workload("lora", model, workload.rows, workload.notes)
    adapters = config.adapters
    if adapters is not None:  # each checked against the base model now: a bad one stops the bench, not a system
        check_adapters(adapters, base_dir)
    else:
        adapters = {f"random-{i}": str(write_adapter(scratch / f"random-{i}", base_dir, rank=RANDOM_RANK, seed=i))
                    for i in range(1, RANDOM_ADAPTERS + 1)}
    names = list(adapters)
    lora_of = {row.id: names[index % len(names)] for index, row in enumerate(workload.rows)}
    workload.notes.append(f"row i on adapter i mod {len(names)} ({', '.join(names)}); greedy, ignore_eos")
    if str(base_dir) != str(model):
        workload.notes.append(f"every system runs {model}'s float conversion ({base_dir})")
    return LoraSetup(workload, engine_args, adapters, lora_of, config.adapters is None)


def base_shape(model_dir: Path):
    from transformers import AutoConfig

    from batchgen.lora import BaseShape
    from batchgen.models.inspector import describe_config

    return BaseShape.of(describe_config(AutoConfig.from_pretrained(model_dir)))


def check_adapters(adapters: dict[str, str], model_dir: Path) -> None:
    """An AdapterError (a ValueError) for the first adapter that cannot run on the model."""
    from batchgen.lora import read_adapter

    shape = base_shape(model_dir)
    for name, path in adapters.items():
        read_adapter(name, Path(path), shape)


def run_engine(name: str, rows: list, args: Any, lora_of: dict[int, str] | None = None) -> SystemRun:
    """One engine over `rows`, each row on its adapter in `lora_of` (none: the base), sorted as a job's `sort:
    prefix` sorts them: an adapter's rows together, by token ids within (neighbours share a prefix)."""
    from batchgen.engine import Engine, Request, SamplingParams

    started = time.monotonic()
    engine = Engine(args)
    load_s = elapsed(started)
    lora_of = lora_of or {}
    requests = [Request(row.id, row.token_ids, SamplingParams(max_tokens=row.max_tokens, temperature=0.0,
                                                              ignore_eos=True), lora=lora_of.get(row.id))
                for row in sorted(rows, key=lambda row: (lora_of.get(row.id) or "", row.token_ids))]
    started, cpu_started = time.monotonic(), time.process_time()
    results = list(engine.generate(requests))
    wall_s, cpu_s = elapsed(started), time.process_time() - cpu_started
    failed = [r for r in results if r.finish_reason == "error"]
    if failed:
        return SystemRun.unavailable(name, f"{len(failed)} rows failed, e.g. row {failed[0].request_id}: "
                                           f"{failed[0].error}")
    details = {"dtype": str(engine.dtype).removeprefix("torch."), "engine_args": dataclasses.asdict(args),
               "steps": engine.num_steps, "cpu_s": cpu_s, "prompt_tokens": sum(r.prompt_tokens for r in results),
               "cached_tokens": sum(r.cached_tokens for r in results)}
    return SystemRun(name, True, load_s=load_s, wall_s=wall_s, details=details,
                     rows=[RowOutput(r.request_id, list(r.token_ids)) for r in results])


def write_merged(base_dir: Path, adapter_name: str, adapter_dir: str, out: Path) -> Path:
    """A copy of model directory `base_dir` with the adapter merged into its weights: W += scale * B @ A, in fp32,
    stored in each tensor's own dtype."""
    from safetensors.torch import load_file, save_file

    from batchgen.lora import read_adapter
    from batchgen.lora.adapter import MLP_MODULES

    adapter = read_adapter(adapter_name, Path(adapter_dir), base_shape(base_dir))
    deltas = {f"model.layers.{layer}.{'mlp' if module in MLP_MODULES else 'self_attn'}.{module}.weight": lora
              for (layer, module), lora in adapter.modules.items()}
    out.mkdir(parents=True, exist_ok=True)
    merged = set()
    for path in sorted(Path(base_dir).iterdir()):
        if path.name == "batchgen-manifest.json" or not path.is_file():
            continue  # the conversion cache's own list of files, which the copy no longer matches
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
            continue
        tensors = load_file(str(path))
        for key in deltas.keys() & tensors.keys():
            lora = deltas[key]
            tensors[key] = (tensors[key].float() + lora.scale * lora.b @ lora.a).to(tensors[key].dtype)
            merged.add(key)
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    if merged != deltas.keys():
        raise ValueError(f"{base_dir} has no weight {sorted(deltas.keys() - merged)[0]} to merge adapter "
                         f"{adapter_name!r} into")
    return out


def run_merged_sequential(setup: LoraSetup, scratch: Path) -> SystemRun:
    """Each adapter's rows on its merged model, one engine after another; merging is done beforehand, untimed."""
    base_dir = Path(setup.engine_args.model)
    runs, merge_s, outputs = [], {}, []
    for name, adapter_dir in setup.adapters.items():
        rows = [row for row in setup.workload.rows if setup.lora_of[row.id] == name]
        if not rows:
            continue
        started = time.monotonic()
        merged_dir = write_merged(base_dir, name, adapter_dir, scratch / f"merged-{name}")
        merge_s[name] = elapsed(started)
        run = run_engine("merged-sequential", rows, dataclasses.replace(setup.engine_args, model=str(merged_dir)))
        shutil.rmtree(merged_dir, ignore_errors=True)
        if not run.available:
            return run
        runs.append((name, run))
        outputs += run.rows
    first = runs[0][1]
    details = {**first.details, "engine_args": {**first.details["engine_args"], "model": "(one merged model each)"},
               "steps": sum(run.details["steps"] for _, run in runs),
               "cpu_s": sum(run.details["cpu_s"] for _, run in runs),
               "prompt_tokens": sum(run.details["prompt_tokens"] for _, run in runs),
               "cached_tokens": sum(run.details["cached_tokens"] for _, run in runs),
               "jobs": [{"adapter": name, "rows": len(run.rows), "merge_s": merge_s[name], "load_s": run.load_s,
                         "wall_s": run.wall_s} for name, run in runs]}
    return SystemRun("merged-sequential", True, load_s=sum(run.load_s for _, run in runs),
                     wall_s=sum(run.wall_s for _, run in runs), rows=outputs, details=details)


def figures(run: SystemRun) -> dict[str, Any]:
    result = availability(run)
    if not run.available:
        return result
    output_tokens = sum(len(row.token_ids) for row in run.rows)
    job_s = run.load_s + run.wall_s
    result.update({"load_s": run.load_s, "wall_s": run.wall_s, "job_s": job_s, "rows": len(run.rows),
                   "prompt_tokens": run.details["prompt_tokens"], "output_tokens": output_tokens,
                   "output_tok_s": output_tokens / run.wall_s, "job_tok_s": output_tokens / job_s,
                   "cpu_s": run.details["cpu_s"],  # the generation's CPU seconds, every thread: what load does not move
                   "prefix_cache_hit_rate": run.details["cached_tokens"] / max(1, run.details["prompt_tokens"]),
                   "peak_rss_bytes": run.peak_rss_bytes, "details": run.details})
    return result


def agreement(lora: SystemRun, merged: SystemRun, setup: LoraSetup, dtype: str) -> dict[str, Any]:
    """Every adapter row's greedy tokens, batchgen-lora against its merged model, by the tests' fp32 rule
    (greedy_check.py): equal, but for near-ties in the merged model's own logits (transformers', the adapter merged)
    in at most 1 row in 20; checked in fp32 only."""
    from .greedy_check import NEAR_TIE_ABS_TOL, allowed_divergences, first_divergence, greedy_verdict

    ours = {row.id: row.token_ids for row in lora.rows}
    theirs = {row.id: row.token_ids for row in merged.rows}
    rows = [row_id for row_id in theirs if setup.lora_of.get(row_id) is not None]
    same = [row_id for row_id in rows if ours.get(row_id) == theirs[row_id]]
    differing = sorted(set(rows) - set(same))
    first_differences = [first_divergence(theirs[row_id], ours.get(row_id, [])) for row_id in differing]
    checked = dtype == "float32"
    result = {"checked": checked, "ok": None, "rows": len(rows), "identical_rows": len(same),
              "identical_share": len(same) / len(rows) if rows else None, "differing_rows": differing[:20],
              "first_difference_at": first_differences[:20],
              "rule": "every adapter row's greedy tokens equal its merged model's but near-ties (|logit gap| <= "
                      f"{NEAR_TIE_ABS_TOL}) in at most 1 row in 20 (fp32 only)"}
    if checked:
        logits = divergence_logits(setup, {row_id: theirs[row_id] for row_id in differing}, dict(zip(
            differing, first_differences)))
        verdict = greedy_verdict([theirs[row_id] for row_id in rows], {rows.index(r): v for r, v in logits.items()},
                                 [ours.get(row_id, []) for row_id in rows], 0.0, NEAR_TIE_ABS_TOL,
                                 allowed_divergences(len(rows)))
        result.update(ok=verdict["ok"], divergences=verdict["divergences"][:20])
    return result


def divergence_logits(setup: LoraSetup, references: dict[int, list[int]],
                      steps: dict[int, int | None]) -> dict[int, dict[int, Any]]:
    """For each differing row, the merged model's logits where the row first differs (transformers' model of the
    base weights with the row's adapter merged in, fp32): row id -> {step: logits}."""
    import torch
    from transformers import AutoModelForCausalLM

    from batchgen.lora import read_adapter
    from batchgen.lora.adapter import MLP_MODULES

    from .greedy_check import next_token_logits

    prompts = {row.id: row.token_ids for row in setup.workload.rows}
    found: dict[int, dict[int, Any]] = {}
    for name, adapter_dir in setup.adapters.items():
        wanted = [row_id for row_id in references if setup.lora_of[row_id] == name and steps[row_id] is not None
                  and steps[row_id] < len(references[row_id])]
        if not wanted:
            continue
        base_dir = Path(setup.engine_args.model)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        adapter = read_adapter(name, Path(adapter_dir), base_shape(base_dir))
        with torch.no_grad():
            for (layer, module), weights in adapter.modules.items():
                owner = model.model.layers[layer]
                owner = owner.mlp if module in MLP_MODULES else owner.self_attn
                getattr(owner, module).weight += weights.scale * weights.b @ weights.a
        for row_id in wanted:
            step = steps[row_id]
            found[row_id] = {step: next_token_logits(model, prompts[row_id] + references[row_id][:step])}
    return found


def comparisons(runs: dict[str, SystemRun], figs: dict[str, dict], setup: LoraSetup) -> dict[str, dict[str, Any]]:
    """batchgen-lora's speed over each other system, against its bar: over base, output tokens/s of the
    generation; over merged-sequential, tokens/s of the whole jobs (load + generation)."""
    ours = figs.get(REFERENCE)
    if not ours or not ours["available"]:
        return {}
    result = {}
    for name, measure in (("base", "output_tok_s"), ("merged-sequential", "job_tok_s")):
        theirs = figs.get(name)
        if not theirs or not theirs["available"]:
            continue
        speedup = ours[measure] / theirs[measure]
        entry = {"measure": measure, "speedup": speedup, "bar": BARS[name], "passes": speedup >= BARS[name],
                 "output_tok_s_ratio": ours["output_tok_s"] / theirs["output_tok_s"],
                 "job_tok_s_ratio": ours["job_tok_s"] / theirs["job_tok_s"],
                 "cpu_s_ratio": theirs["cpu_s"] / ours["cpu_s"]}  # generation's CPU time: theirs over ours
        if name == "base":  # the adapters change the outputs: the share of rows that equal the base model's
            base_rows = {row.id: row.token_ids for row in runs[name].rows}
            entry["rows_as_base"] = sum(base_rows.get(row.id) == row.token_ids for row in runs[REFERENCE].rows)
        else:
            entry["agreement"] = agreement(runs[REFERENCE], runs[name], setup, ours["dtype"])
            entry["identical_share"] = entry["agreement"]["identical_share"]
        result[name] = entry
    return result


def run_lora_bench(config: LoraBenchConfig, log: Callable[[str], None] = print) -> BenchResult:
    config.validate()
    started_at = datetime.now(timezone.utc)
    commit = git_commit()
    with tempfile.TemporaryDirectory(prefix="batchgen-lora-bench-") as scratch_name:
        scratch = Path(scratch_name)
        setup = build_setup(config, scratch)
        workload = setup.workload
        log(f"bench: workload lora: {len(workload.rows)} rows over {len(setup.adapters)} adapters "
            f"({'random, rank ' + str(RANDOM_RANK) if setup.random_adapters else 'given'}), "
            f"{workload.prompt_tokens:,} prompt tokens, exactly {workload.max_output_tokens:,} output tokens; "
            f"dtype {setup.engine_args.dtype}")
        runners = {"base": lambda rows, options: run_engine("base", rows, options.engine_args),
                   "batchgen-lora": lambda rows, options: run_engine(
                       "batchgen-lora", rows, dataclasses.replace(options.engine_args, lora=setup.adapters,
                                                                  max_loras=4), setup.lora_of),
                   "merged-sequential": lambda rows, options: run_merged_sequential(setup, scratch)}
        options = BenchOptions(setup.engine_args, dtype=setup.engine_args.dtype, ignore_eos=True)
        runs: dict[str, SystemRun] = {}
        for name in dict.fromkeys(config.systems):
            log(f"bench: running {name}")
            runs[name] = run = run_system(name, workload.rows, options, runners)
            log(f"bench: {name}: " + (f"load {run.load_s:.1f} s, generation {run.wall_s:.1f} s" if run.available
                                      else f"unavailable: {run.reason}"))
        figs = {name: figures(run) for name, run in runs.items()}
        compared = comparisons(runs, figs, setup)  # while the adapters are there: a near-tie check reads them
    present = cpu_flags() or set()
    record = {
        "workload": {**workload.describe(), "adapters": len(setup.adapters)}, "kind": "lora",
        "date": started_at.isoformat(), "git_commit": commit, "machine": machine_info(),
        "cpu_flags": [flag for flag in BRIEF_FLAGS if flag in present],
        "config": {**dataclasses.asdict(config), "engine_args": dataclasses.asdict(setup.engine_args)},
        "adapters": {name: {"path": None if setup.random_adapters else path, "random": setup.random_adapters,
                            "rank": RANDOM_RANK if setup.random_adapters else None}
                     for name, path in setup.adapters.items()},
        "reference": REFERENCE if REFERENCE in runs and runs[REFERENCE].available else None,
        "systems": figs, "comparisons": compared,
        "rows": {name: [{"id": row.id, "adapter": setup.lora_of[row.id] if name != "base" else None,
                         "token_ids": row.token_ids} for row in sorted(run.rows, key=lambda row: row.id)]
                 for name, run in runs.items() if run.available},
    }
    stamp = started_at.strftime("%Y%m%d-%H%M%S")
    record_path = Path(config.out_dir) / f"bench-lora-{stamp}.json"
    archive_path = Path(config.archive)
    report.write_record(record, record_path)
    report.append_archive(record, archive_path)  # without the rows' tokens and tracebacks
    return BenchResult(record, record_path, None, archive_path, runs)


def format_lora_table(record: dict[str, Any]) -> str:
    workload, machine = record["workload"], record["machine"]
    header = ["system", "dtype", "rows", "load s", "gen s", "gen cpu s", "job s", "out tok", "out tok/s", "job tok/s",
              "cache hit", "peak RSS", "lora x"]
    systems, compared = record["systems"], record["comparisons"]
    unavailable = [f"  {name}: unavailable — {f['reason']}" for name, f in systems.items() if not f["available"]]
    lines = [[name, short_dtype(f["dtype"]), str(f["rows"]), _fmt(f["load_s"]), _fmt(f["wall_s"]), _fmt(f["cpu_s"]),
              _fmt(f["job_s"]),
              f"{f['output_tokens']:,}", _fmt(f["output_tok_s"], ",.0f"), _fmt(f["job_tok_s"], ",.0f"),
              _fmt(f["prefix_cache_hit_rate"], ".0%"), _fmt((f["peak_rss_bytes"] or 0) / 2**20, ",.0f", " MiB"),
              _fmt(compared.get(name, {}).get("speedup"), ".2f", "x")] for name, f in systems.items() if f["available"]]
    title = (f"batchgen bench: lora, {workload['rows']} rows over {workload['adapters']} adapters, "
             f"{workload['prompt_tokens']:,} prompt tokens, {workload['max_output_tokens']:,} output tokens; model "
             f"{workload['model']} ({record['date'][:19]}, {machine['cpu']}, {machine['cores']} cores, "
             f"{machine['torch_threads']} torch threads; flags {', '.join(record['cpu_flags']) or '-'})")
    parts = [title] + ([render_table(header, lines)] if lines else []) + unavailable
    for name, entry in compared.items():
        what = "output tok/s (generation)" if name == "base" else "job tok/s (each engine's load + generation)"
        parts.append(f"  bar: batchgen-lora / {name}, {what}: {entry['speedup']:.2f}x, at least "
                     f"{entry['bar']:g}x: {'pass' if entry['passes'] else 'FAIL'}")
        agreed = entry.get("agreement")
        if agreed is not None:
            verdict = "not checked (fp32 only)" if not agreed["checked"] else "ok" if agreed["ok"] else "FAILS"
            parts.append(f"  agreement with the merged models: {agreed['identical_rows']}/{agreed['rows']} adapter "
                         f"rows' greedy tokens equal: {verdict}")
    parts.append("  lora x = batchgen-lora's speed over the system's (over base: out tok/s; over merged-sequential: "
                 "job tok/s); merged-sequential: one engine per merged model, one after another, merging untimed")
    return "\n".join(parts)
