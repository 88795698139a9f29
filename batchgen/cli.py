"""`batchgen run JOB.yaml`: exit 0 when the output is complete, 2 for a problem with the job found before the model
loads (one line naming the key, file or column), 1 for a failure while running (committed rows stay committed)."""
from __future__ import annotations

import logging
import signal
import sys
import time
import traceback

import click

import batchgen

EXIT_OK, EXIT_RUNTIME, EXIT_JOB, EXIT_INTERRUPTED = 0, 1, 2, 130


@click.group()
@click.version_option(batchgen.__version__, prog_name="batchgen")
def main() -> None:
    """batchgen: offline batch generation for LLMs (Parquet in, Parquet out)."""


@main.command()
@click.argument("job", metavar="JOB.yaml")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a job key, e.g. --set engine.max_num_seqs=64 (repeatable).")
@click.option("--overwrite", is_flag=True, help="Discard the output of an earlier run and start over.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, no summary.")
def run(job: str, overrides: tuple[str, ...], overwrite: bool, quiet: bool) -> None:
    """Run the job in JOB.yaml; re-running the same command resumes it."""
    from batchgen.job import JobConfigError, execute_job, load_job, prepare_job

    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="batchgen: %(message)s")
    try:
        prepared = prepare_job(load_job(job, overrides), overwrite=overwrite)
    except JobConfigError as exc:
        _fail(EXIT_JOB, str(exc))
    if prepared.complete is not None:
        click.echo(f"batchgen: {prepared.out.path} is already complete ({prepared.complete.get('rows', 0)} rows); "
                   f"nothing to do (--overwrite runs it again)", err=True)
        sys.exit(EXIT_OK)

    bar = ProgressBar(disable=quiet or not sys.stderr.isatty())
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # a scheduler's kill: commit what finished
    try:
        summary = execute_job(prepared, on_progress=bar.update, on_start=bar.start)
    except JobConfigError as exc:
        bar.close()
        _fail(EXIT_JOB, str(exc))
    except KeyboardInterrupt:
        bar.close()
        _fail(EXIT_INTERRUPTED, "interrupted; finished rows are committed, re-run the same command to resume")
    except Exception as exc:
        bar.close()
        traceback.print_exc()
        _fail(EXIT_RUNTIME, f"runtime failure: {type(exc).__name__}: {exc} "
                            f"(committed rows are kept; re-run the same command to resume)")
    finally:
        signal.signal(signal.SIGTERM, previous)
    bar.close()
    if not quiet:
        click.echo(summary_table(summary, str(prepared.out.path)), err=True)


def _fail(code: int, message: str) -> None:
    click.echo(f"batchgen: error: {message}", err=True)
    sys.exit(code)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class ProgressBar:
    """tqdm over rows (done/total), with output tokens/s and the prefix-cache hit rate of this run."""

    def __init__(self, disable: bool):
        self.disable = disable
        self.bar = None
        self.last_postfix = 0.0

    def start(self, progress) -> None:
        if self.disable:
            return
        from tqdm import tqdm
        self.bar = tqdm(total=progress.rows_total, initial=progress.rows_done, unit="row", file=sys.stderr,
                        dynamic_ncols=True)

    def update(self, progress) -> None:
        if self.bar is None:
            return
        self.bar.update(progress.rows_done - self.bar.n)
        now = time.monotonic()
        if now - self.last_postfix >= 0.5 or progress.rows_done == progress.rows_total:
            self.last_postfix = now
            self.bar.set_postfix_str(f"{progress.output_tokens_per_s:.0f} tok/s, "
                                     f"prefix cache {progress.prefix_cache_hit_rate:.0%}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def summary_table(s: dict, path: str) -> str:
    hit = s["prefix_cache_hit_rate"]
    resumed = f" (this run: {s['rows_this_run']})" if s.get("resumed") else ""
    lines = [
        ("rows", f"{s['rows']:,}{resumed}: {s['rows_ok']:,} ok, {s['rows_error']:,} error"),
        ("prompt tokens", f"{s['prompt_tokens']:,} ({s['cached_tokens']:,} from the prefix cache, {hit:.1%})"),
        ("output tokens", f"{s['output_tokens']:,} ({s['output_tokens_per_s']:,.1f} tok/s this run)"),
        ("wall time", f"{s['wall_s']:.1f} s"),
        ("preemptions", f"{s['preemptions']:,}"),
        ("peak memory", f"{s['peak_memory_bytes'] / 2**20:,.0f} MiB"),
        ("output", f"{path}  (polars.read_parquet(\"{path}/*.parquet\"))"),
    ]
    width = max(len(name) for name, _ in lines)
    return "\n".join(["batchgen: done"] + [f"  {name:<{width}}  {value}" for name, value in lines])
