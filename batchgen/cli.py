"""`batchgen run JOB.yaml`: exit 0 when the output is complete, 2 for a problem with the job found before the model
loads (one line naming the key, file or column), 1 for a failure while running (committed rows stay committed),
75 while another run writes the output (retry later), 130 when interrupted; then one `batchgen: error:` line."""
from __future__ import annotations

import importlib
import json
import logging
import math
import signal
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import click

from batchgen.failures import EXIT_BUSY, EXIT_INTERRUPTED, EXIT_JOB, EXIT_OK, EXIT_RUNTIME, fail
from batchgen.redaction import redact, redact_log_records
from batchgen.versions import print_version



class PositivePrice(click.FloatRange):
    """A price per hour: a finite number above 0 (nan and inf would end up in _SUCCESS, which must stay JSON)."""

    def __init__(self):
        super().__init__(min=0, min_open=True)

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class BatchgenGroup(click.Group):
    """click's group, but a usage error (an unknown option, a bad value) ends, like every failure, with one
    `batchgen: error: ...` line, after click's usage lines. `bench` is imported only when it is asked for."""

    LAZY = {"bench": "batchgen.bench.command"}  # command name -> the module that defines it

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *self.LAZY])

    def get_command(self, ctx, name):
        if name in self.LAZY:
            return getattr(importlib.import_module(self.LAZY[name]), name)
        return super().get_command(ctx, name)

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            if isinstance(exc, getattr(click.exceptions, "NoArgsIsHelpError", ())):  # `batchgen` alone: its help
                click.echo(exc.format_message(), err=True)
                click.echo("batchgen: error: no command given", err=True)
                sys.exit(exc.exit_code)
            if ctx is not None:
                click.echo(ctx.get_usage(), err=True)
                click.echo(f"Try '{ctx.command_path} --help' for help.", err=True)
            click.echo(f"batchgen: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:  # Ctrl-C before a command's own handling began
            click.echo("batchgen: error: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)


@click.group(cls=BatchgenGroup)
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=print_version,
              help="Show batchgen's version and those of the libraries it runs on, and exit.")
def main() -> None:
    """batchgen: offline batch generation for LLMs (Parquet in, Parquet out)."""
    redact_log_records()  # no credential in any log line, a library's included


def run_options(command: Callable) -> Callable:
    """The options `run` and `run-batch` share."""
    options = [
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Override a job key, e.g. --set engine.max_num_seqs=64 (repeatable)."),
        click.option("--overwrite", is_flag=True, help="Discard the output of an earlier run and start over."),
        click.option("--executor", type=click.Choice(["local", "ray"]), default=None,
                     help="Where the engine runs (the job's executor.kind; ray: replicas on a Ray cluster via Ray "
                          "Data)."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bar, no summary."),
        click.option("--debug", is_flag=True, envvar="BATCHGEN_DEBUG",
                     help="Print the traceback of a failure (also with BATCHGEN_DEBUG=1)."),
        click.option("--cost-per-hour", type=PositivePrice(), default=None, metavar="USD",
                     help="Price of this machine per hour: _SUCCESS then records cost_per_hour and "
                          "tokens_per_dollar."),
        click.option("--progress-interval", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
                     metavar="SECONDS", help="Where stderr is not a terminal (or with --log-format json): a progress "
                                             "line this often instead of the progress bar."),
        click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
                     help="json: every line batchgen writes to stderr is one JSON object (progress, warnings, the "
                          "summary, the error)."),
        click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, metavar="PORT",
                     help="Serve Prometheus metrics on this port while the run lives (needs the metrics extra)."),
        click.option("--metrics-linger", type=click.FloatRange(min=0), default=0.0, metavar="SECONDS",
                     help="Keep serving the final metrics this long after the run's end."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@main.command()
@click.argument("job", metavar="JOB.yaml")
@run_options
def run(job: str, overrides: tuple[str, ...], **options: Any) -> None:
    """Run the job in JOB.yaml; re-running the same command resumes it."""
    from batchgen.job import load_job

    run_job(lambda extra: load_job(job, (*overrides, *extra)), **options)


@main.command("run-batch")
@click.option("-i", "--input-file", "requests", required=True, metavar="REQUESTS.jsonl",
              help="An OpenAI Batch request file (a local path or s3://...).")
@click.option("-o", "--output-file", "results", required=True, metavar="RESULTS.jsonl",
              help="Where the answered requests go; failed ones go to RESULTS.errors.jsonl.")
@click.option("--model", default="default", show_default=True, help="The model that answers every request.")
@click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME=ADAPTER",
              help="A LoRA adapter (a PEFT directory, a hub id or s3:// prefix) that answers the requests whose body "
                   "names NAME as its model; repeat for more (as vllm run-batch's --lora-modules).")
@run_options
def run_batch(requests: str, results: str, model: str, lora_modules: tuple[str, ...], overrides: tuple[str, ...],
              **options: Any) -> None:
    """Run an OpenAI Batch file as `vllm run-batch` does, as a batchgen job (its work directory:
    RESULTS.jsonl.batchgen/); re-running the same command resumes it."""
    from batchgen.job import parse_job
    from batchgen.job.job_file import apply_override
    from batchgen.job.run_batch import assemble, batch_job

    def load(extra: tuple[str, ...]):
        raw = batch_job(requests, results, model, lora_modules)
        for item in (*overrides, *extra):
            apply_override(raw, item)
        return parse_job(raw)

    summary = run_job(load, **options)
    with reported_failures(options["debug"], resumable=False, as_json=options["log_format"] == "json"):
        target, errors = assemble(results, summary)
    if not options["quiet"]:
        click.echo(f"batchgen: wrote {target}" + (f" and {errors}" if errors else ""), err=True)


def run_job(load: Callable[[tuple[str, ...]], Any], overwrite: bool, executor: str | None, quiet: bool, debug: bool,
            cost_per_hour: float | None, progress_interval: float, log_format: str, metrics_port: int | None,
            metrics_linger: float) -> dict:
    """Load (with the command's own overrides), prepare and run a job, showing its progress; returns its summary
    (the earlier one where it was already complete). A failure exits, after saying why."""
    from batchgen.job import execute_job, prepare_job
    from batchgen.job.progress_log import ProgressLog

    extra = (f"executor.kind={executor}",) if executor is not None else ()
    as_json = log_format == "json"
    configure_logging(quiet, as_json)
    terminal = sys.stderr.isatty() and not as_json
    bar = ProgressBar(disable=quiet or not terminal)
    progress_log = ProgressLog(progress_interval) if not quiet and not terminal else None
    shows = [shown for shown in (bar, progress_log) if shown is not None]
    metrics = None

    def close() -> None:
        for shown in shows:
            shown.close()

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # a scheduler's kill: commit what finished
    try:
        with reported_failures(debug, before_exit=close, as_json=as_json):
            if metrics_port is not None:  # served from the start: a scraper finds it during the model load too
                metrics = metrics_server(metrics_port, metrics_linger)
                shows.append(metrics)
            prepared = prepare_job(load(extra), overwrite=overwrite)
            prepared.cost_per_hour = cost_per_hour
            if prepared.complete is not None:
                message = redact(f"{prepared.out.path} is already complete ({prepared.complete.get('rows', 0)} "
                                 f"rows); nothing to do (--overwrite runs it again)")
                click.echo(json.dumps({"level": "info", "logger": "batchgen", "message": message}) if as_json
                           else f"batchgen: {message}", err=True)
                return prepared.complete
            summary = execute_job(prepared, on_progress=lambda p: [shown.update(p) for shown in shows],
                                  on_start=lambda p: [shown.start(p) for shown in shows])
    finally:
        signal.signal(signal.SIGTERM, previous)
    for shown in shows:
        if shown is not metrics:
            shown.close()
    if not quiet and as_json:
        logging.getLogger("batchgen.cli").info("done", extra={"summary": summary})
    elif not quiet:
        from batchgen.job.run_summary import summary_table
        click.echo(redact(summary_table(summary, str(prepared.out.path))), err=True)
    if metrics is not None:
        metrics.close(finished=True)  # after the summary: lingering, it serves the final values
    return summary


def metrics_server(port: int, linger_s: float):
    """The run's Prometheus endpoint (job/metrics.py); a port it cannot listen on, or no prometheus_client, is a
    problem with the command (exit 2)."""
    from batchgen.job import JobConfigError

    try:
        from batchgen.job.metrics import MetricsServer
        return MetricsServer(port, linger_s)
    except ImportError:
        raise JobConfigError("--metrics-port needs prometheus_client, which is not installed: pip install -e "
                             "\".[metrics]\" in batchgen's checkout (scripts/setup.sh installs it)") from None
    except OSError as exc:
        raise JobConfigError(f"--metrics-port {port}: cannot listen ({exc.strerror or exc})") from None


def configure_logging(quiet: bool, as_json: bool = False) -> None:
    """batchgen's own messages at INFO (WARNING with --quiet); other libraries' only from WARNING, so that none of
    their INFO lines (torch's at exit, say) lands after a failure's last line. as_json: each line a JSON object."""
    logging.basicConfig(level=logging.WARNING, format="batchgen: %(message)s")
    if as_json:
        from batchgen.job.progress_log import JsonFormatter
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    for name in ("batchgen", "batchgen_kernels"):
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.INFO)


def quality_lines(config, rows: int) -> list[str]:
    """`plan --quality N`'s lines (job/plan/quality.py)."""
    from batchgen.job.plan.quality import quality_gate
    from batchgen.job.plan.estimate import PLAN_NO_DOWNLOAD
    from batchgen.job.prepare import inspect_job

    return quality_gate(inspect_job(config, PLAN_NO_DOWNLOAD), rows)


@main.command()
@click.argument("job", metavar="JOB.yaml")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a job key, as with run (repeatable).")
@click.option("--overwrite", is_flag=True, help="Plan a run with --overwrite (nothing is removed).")
@click.option("--sample-rows", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Rows read, built and tokenized for the token statistics (the first ones of the input).")
@click.option("--cost-per-hour", type=PositivePrice(), default=None, metavar="USD",
              help="Price of this machine per hour: the plan adds the job's cost and output tokens per dollar.")
@click.option("--archive", default="docs/performance-archive.jsonl", show_default=True, metavar="PATH",
              help="The bench archive the time estimate reads, relative to the current directory (the default: "
                   "where a batchgen checkout keeps its bench records).")
@click.option("--no-probe", is_flag=True,
              help="Without a bench record for this machine, give no time estimate instead of timing a few engine "
                   "steps on the job's model and rows (a probe of a few seconds, which loads the weights).")
@click.option("--quality", type=click.IntRange(min=1), default=None, metavar="N",
              help="The quality gate: run N of the job's rows greedily with its settings and with its quality levers "
                   "(quantization, ...) off, and print how often texts and choice labels agree and the "
                   "log-likelihood difference (loads the model twice).")
@click.option("--debug", is_flag=True, envvar="BATCHGEN_DEBUG",
              help="Print the traceback of a failure (also with BATCHGEN_DEBUG=1).")
def plan(job: str, overrides: tuple[str, ...], overwrite: bool, sample_rows: int, cost_per_hour: float | None,
         archive: str, no_probe: bool, quality: int | None, debug: bool) -> None:
    """Check JOB.yaml as run would and print the plan (prompts, tokens, memory, time, resume state) without
    writing anything. The weights load only for the time probe, where no bench record serves (--no-probe: never).
    Exit 2 for a problem run would refuse, or a memory estimate above the memory available."""
    from pathlib import Path

    import psutil

    from batchgen.job import load_job
    from batchgen.job.plan.estimate import make_plan
    from batchgen.job.plan.report import format_plan

    logging.basicConfig(level=logging.WARNING, format="batchgen: %(message)s")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # killed while blocked: still one error line
    try:
        with reported_failures(debug, resumable=False):
            made = make_plan(load_job(job, overrides), overwrite, sample_rows, cost_per_hour, Path(archive),
                             probe=not no_probe, process_started=psutil.Process().create_time())
            gate = quality_lines(load_job(job, overrides), quality) if quality and not made.problems else []
    finally:
        signal.signal(signal.SIGTERM, previous)
    click.echo(redact("\n".join([format_plan(made, job), *gate])))
    for warning in made.warnings:
        click.echo(redact(f"batchgen: warning: {warning}"), err=True)
    for problem in made.problems:
        click.echo(redact(f"batchgen: error: {problem}"), err=True)
    sys.exit(EXIT_JOB if made.problems else EXIT_OK)


@main.command()
@click.argument("output", metavar="OUTPUT")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the line.")
@click.option("--debug", is_flag=True, envvar="BATCHGEN_DEBUG",
              help="Print the traceback of a failure (also with BATCHGEN_DEBUG=1).")
def status(output: str, as_json: bool, debug: bool) -> None:
    """What the job writing OUTPUT (a directory or s3://...) has committed: rows done of the total, whether a run
    is writing it, its rate over the last commits and an ETA; read from the output without disturbing the run."""
    from batchgen.job.status import format_status, output_status

    logging.basicConfig(level=logging.WARNING, format="batchgen: %(message)s")
    with reported_failures(debug, resumable=False, as_json=as_json):
        found = output_status(output)
    click.echo(redact(json.dumps(found) if as_json else format_status(found)))


@main.command()
@click.argument("outputs", nargs=-1, required=True, metavar="OUTPUT [OUTPUT...]")
@click.option("-o", "--out", "target", default=None, metavar="FILE",
              help="Where to write the page. Default: one OUTPUT's own _report.html; for several, "
                   "./batchgen-report.html.")
@click.option("--debug", is_flag=True, envvar="BATCHGEN_DEBUG",
              help="Print the traceback of a failure (also with BATCHGEN_DEBUG=1).")
def report(outputs: tuple[str, ...], target: str | None, debug: bool) -> None:
    """Draw the job report of a finished OUTPUT (a directory or s3://...) again, or of several side by side: each
    chart draws every output, the table gives each figure's ratio to the first's."""
    from batchgen.job.report import write_report

    logging.basicConfig(level=logging.WARNING, format="batchgen: %(message)s")
    with reported_failures(debug, resumable=False):
        written = write_report(list(outputs), target)
    click.echo(redact(written))


@contextmanager
def reported_failures(debug: bool, before_exit: Callable[[], None] = lambda: None,
                      resumable: bool = True, as_json: bool = False) -> Iterator[None]:
    """Every failure inside as its exit code and one last stderr line (a traceback before it only with --debug):
    a problem with the job 2, an output another run is writing 75, an interrupt 130, anything else 1. `resumable`:
    the failure happened in a run, whose committed rows a re-run keeps (not in a plan, which writes nothing)."""
    from batchgen.job import JobConfigError, OutputBusy

    try:
        yield
    except JobConfigError as exc:
        before_exit()
        fail(EXIT_BUSY if isinstance(exc, OutputBusy) else EXIT_JOB, str(exc), debug, as_json)
    except KeyboardInterrupt:
        before_exit()
        fail(EXIT_INTERRUPTED, "interrupted; finished rows are committed, re-run the same command to resume"
              if resumable else "interrupted", debug, as_json)
    except Exception as exc:
        before_exit()
        text = str(exc).strip()
        detail = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        hint = "committed rows are kept; re-run the same command to resume" if resumable else "nothing was written"
        fail(EXIT_RUNTIME, f"runtime failure: {detail} ({hint}{'' if debug else '; --debug shows the traceback'})",
              debug, as_json)


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
