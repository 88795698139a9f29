"""executor.kind: ray — the job's rows on engine replicas of a Ray cluster (open_engine's: a decoder's Engine or an
encoder's), through Ray Data, written by this process (the driver) with the same sink as a local run.

    windows: input row ranges the ledger has not committed (metadata only: the driver never holds the input)
      └─► Ray Data map_batches(EngineReplica, one window per batch, `replicas` actors)
            each replica reads its window, builds and tokenizes the prompts, sorts them (its prefix cache hits as a
            local run's does) and streams them through its one Engine (the public request API: generate)
      ◄── the driver iterates the results and writes them through PartWriter: the part files, the ledger, the
          final rewrite and _SUCCESS are the local run's

Exactly once: a row is committed only by the driver, with all of its samples at once, and the ledger of committed
rows is the resume point (a killed driver: the next run skips them). A replica that dies is restarted by Ray and its
window run again; the rows it had already returned come back a second time and the driver drops them (`written`).
Writing on the driver keeps one ledger and one ordering; where that stops scaling is in docs/scaling.md.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from batchgen.engine import Request, Result

from ..config import JobConfig
from ..output.part_writer import PartWriter
from ..prepare import PreparedJob, check_chat_template, engine_args_for
from .base import ExecutorRun, error_result, result_groups


@dataclass
class ReplicaTotals:
    """What one replica did, for _SUCCESS."""

    rows: int = 0
    output_rows: int = 0
    output_tokens: int = 0
    first_arrival: float | None = None
    last_finish: float | None = None
    engine_stats: dict = field(default_factory=dict)

    def add(self, results: list[Result]) -> None:
        self.rows += 1
        self.output_rows += len(results)
        for result in results:
            self.output_tokens += result.output_tokens
            arrival, finish = result.arrival_time, result.finish_time
            self.first_arrival = arrival if self.first_arrival is None else min(self.first_arrival, arrival)
            self.last_finish = finish if self.last_finish is None else max(self.last_finish, finish)

    def summary(self) -> dict:
        wall = (self.last_finish - self.first_arrival) if self.first_arrival is not None else 0.0
        return {"rows": self.rows, "output_rows": self.output_rows, "output_tokens": self.output_tokens,
                "wall_s": wall, "engine_stats": self.engine_stats}


def plan_windows(done: bytearray, window: int) -> list[dict[str, Any]]:
    """[start, stop) ranges of `window` input positions with the ledger's bits for them (1: committed), leaving
    out ranges whose rows are all committed. The bits travel with their window: no replica holds the whole ledger."""
    return [{"start": start, "stop": min(start + window, len(done)), "done": bytes(done[start:start + window])}
            for start in range(0, len(done), window) if not all(done[start:start + window])]


def window_size(config: JobConfig, rows_left: int) -> int:
    """executor.batch_size, else enough windows for every replica to get about four (a replica drains its engine
    at the end of each window), but no more rows than input.sort_window."""
    if config.executor.batch_size is not None:
        return config.executor.batch_size
    return max(1, min(config.input.sort_window, math.ceil(rows_left / (4 * config.executor.replicas))))


class ReplicaIndex:
    """Numbers the replicas as they start (0, 1, ...); a restarted replica gets the next number."""

    def __init__(self) -> None:
        self.count = 0

    def next(self) -> int:
        self.count += 1
        return self.count - 1


class EngineReplica:
    """One Engine in a Ray actor. Each call gets one window of input positions and yields its rows' results as
    they finish: (row, replica, pickled (id, kept values, results, whether output.parse_json applies)). Pickling
    keeps every Result field and the input's own id and kept value types across Ray Data's Arrow blocks."""

    def __init__(self, config: JobConfig, inputs: Any, engine_args: Any, threads: int, counter: Any):
        import ray
        import torch

        from ..input.source import PromptBuilder

        torch.set_num_threads(threads)
        self.config, self.inputs = config, inputs
        self.engine = self.make_engine(engine_args)
        self.builder = PromptBuilder(config, inputs, self.engine.tokenizer, self.engine.max_model_len,
                                     getattr(self.engine, "context_limit", None))
        self.index = ray.get(counter.next.remote())

    def make_engine(self, engine_args: Any) -> Any:
        from batchgen.engine import open_engine

        return open_engine(engine_args)

    def __call__(self, batch: dict) -> Iterator[dict]:
        from ..input.source import read_window

        for start, stop, done in zip(batch["start"], batch["stop"], batch["done"]):
            rows = read_window(self.config, self.inputs, self.builder, int(start), int(stop), bytes(done))
            out: list[tuple[int, bytes]] = []
            kept = {row.row: row for row in rows}
            schema = self.config.sampling.json_schema
            for row in rows:
                if row.error is not None:
                    out.append((row.row, pickle.dumps((row.id, row.keep, [error_result(row)], True))))
            requests = [Request(row.row, row.token_ids, row.sampling, pooling_params=row.pooling, lora=row.lora)
                        for row in rows if row.error is None]
            for results in result_groups(self.engine.generate(requests), lambda row: kept[row].sampling.n):
                row = kept[results[0].request_id]
                out.append((row.row, pickle.dumps((row.id, row.keep, results, row.sampling.json_schema == schema))))
                if len(out) >= 64:
                    yield self._batch(out)
                    out = []
            if out:
                yield self._batch(out)

    def _batch(self, out: list[tuple[int, bytes]]) -> dict:
        return {"row": [row for row, _ in out], "replica": [self.index] * len(out),
                "payload": [payload for _, payload in out],
                "engine_stats": [pickle.dumps(self.engine.stats())] + [b""] * (len(out) - 1)}


def connect(address: str | None) -> bool:
    """Join the cluster at `address` (default: RAY_ADDRESS), else start a local Ray for this run. Returns whether
    this call started Ray (and so should shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    # Errors only: Ray's warnings (token authentication, progress bars off) are not the job's, and a --quiet run of a
    # scheduled pipeline should print nothing but failures.
    for attempt in (1, 2):
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
            break
        except Exception as exc:  # a local Ray waits a fixed 30 s for its raylet: a loaded machine can miss it once
            if address or attempt == 2 or "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    return True


def run_on_ray(config: JobConfig, inputs: Any, done: bytearray, engine_args: Any,
               write: Callable[[int, Any, tuple, list[Result], bool, int], None],
               replica_class: type = EngineReplica,
               on_stats: Callable[[str, dict], None] = lambda lane, stats: None) -> dict:
    """Generate every row not in `done` on `config.executor.replicas` replicas, calling write(row, id, kept
    values, results, parse_json, replica) once per row (a row a retried window returns again is dropped), and
    on_stats(`replica N`, its engine stats) as each replica's arrive. Returns the per-replica totals for _SUCCESS.
    `replica_class`: an EngineReplica (dev/driver_throughput.py passes one whose engine answers instantly)."""
    import ray
    import ray.data

    executor = config.executor
    started_ray = connect(executor.address)
    try:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.execution_options.verbose_progress = False
        gpus = executor.gpus_per_replica if engine_args.device != "cpu" and _cluster_has_gpus() else 0
        counter = ray.remote(ReplicaIndex).options(num_cpus=0).remote()
        windows = plan_windows(done, window_size(config, done.count(0)))
        dataset = ray.data.from_items(windows, override_num_blocks=max(1, len(windows))).map_batches(
            replica_class, batch_size=1, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=executor.replicas),
            fn_constructor_kwargs={"config": config, "inputs": inputs, "engine_args": engine_args,
                                   "threads": executor.cpus_per_replica, "counter": counter},
            num_cpus=executor.cpus_per_replica, num_gpus=gpus)  # Ray Data restarts a dead replica, retries its window
        written = bytearray(done)
        totals: dict[int, ReplicaTotals] = {}
        for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            for row, replica, payload, stats in zip(batch["row"], batch["replica"], batch["payload"],
                                                    batch["engine_stats"]):
                replica_totals = totals.setdefault(int(replica), ReplicaTotals())
                if stats:
                    replica_totals.engine_stats = pickle.loads(stats)
                    on_stats(f"replica {int(replica)}", replica_totals.engine_stats)
                row = int(row)
                if written[row]:
                    continue  # a retried window's row, already written
                written[row] = 1
                ident, keep, results, parse_json = pickle.loads(payload)
                replica_totals.add(results)
                write(row, ident, keep, results, parse_json, int(replica))
        return {str(index): totals[index].summary() for index in sorted(totals)}
    finally:
        if started_ray:
            ray.shutdown()


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


class RayExecutor:
    def run(self, job: PreparedJob, sink: PartWriter, on_row: Callable[[list[Result]], None],
            on_start: Callable[[], None], on_stats: Callable[[str, Any], None]) -> ExecutorRun:
        """The rows left on Ray replicas; this process (the driver) writes them."""
        from batchgen.models.loader import engine_model_dir, load_tokenizer

        config = job.config
        check_chat_template(config, load_tokenizer(engine_model_dir(job.model, config.task)))
        on_start()

        def write(row: int, ident: Any, keep: tuple, results: list[Result], parse_json: bool, replica: int) -> None:
            sink.add(row, ident, keep, *results, parse_json=parse_json, replica=replica)
            on_row(results)

        from ..calibration import calibrated_args  # measured here, once: every replica keeps the same layers

        engine_args = calibrated_args(job, engine_args_for(config, job.done.count(0), job.model, job.adapters))
        replicas = run_on_ray(config, job.inputs, job.done, engine_args, write, on_stats=on_stats)
        return ExecutorRun(replicas=replicas)
