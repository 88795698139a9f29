"""What an executor is: given a prepared job and the sink (the part writer), produce every row's results and
write each row once, with all of its samples together. `local.py` runs one Engine in this process, `ray.py` engine
replicas on a Ray cluster; `runner.execute_job` picks one by executor.kind and does the rest."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol

from batchgen.engine import Result

if TYPE_CHECKING:
    from ..input.source import SourceRow
    from ..output.part_writer import PartWriter
    from ..prepare import PreparedJob


@dataclass
class ExecutorRun:
    """What an executor reports for _SUCCESS."""

    engine_stats: dict = field(default_factory=dict)  # the engine's, when it ran in this process
    replicas: dict | None = None  # a Ray run: what each replica did

    def final_stats(self) -> dict[str, dict]:
        """Each engine's final stats by its timeline lane."""
        if self.replicas is not None:
            return {f"replica {index}": replica["engine_stats"] for index, replica in self.replicas.items()
                    if replica.get("engine_stats")}
        return {"engine": self.engine_stats} if self.engine_stats else {}


class Executor(Protocol):
    def run(self, job: PreparedJob, sink: PartWriter, on_row: Callable[[list[Result]], None],
            on_start: Callable[[], None], on_stats: Callable[[str, dict | Callable[[], dict]], None]) -> ExecutorRun:
        """Write the rows `job.done` has not committed to `sink`, calling on_row(results) after each; on_start()
        once the model is loaded and rows are about to flow; on_stats(lane, stats) with an engine's stats as they
        come (`engine`: the local engine's stats method, called only if a sample is due; `replica N`: the stats a Ray
        replica sent with its results). on_row and on_stats are called from one thread, between rows."""
        ...


def result_groups(results: Iterable[Result], samples: Callable[[Any], int]) -> Iterator[list[Result]]:
    """Each request's results together, in sample order, once all `samples(request_id)` of them arrived (or its one
    error result): the engine returns a request's samples in one step, but a caller must not rely on how its
    results are cut into steps."""
    arrived: dict[Any, list[Result]] = {}
    for result in results:
        group = arrived.setdefault(result.request_id, [])
        group.append(result)
        if len(group) < samples(result.request_id) and result.finish_reason != "error":
            continue
        del arrived[result.request_id]
        yield sorted(group, key=lambda sample: sample.sample_index)
    if arrived:
        request_id, group = next(iter(arrived.items()))
        raise RuntimeError(f"internal error: the engine returned {len(group)} of the {samples(request_id)} samples "
                           f"of row {request_id}")


def error_result(row: SourceRow) -> Result:
    return Result.for_error(row.row, row.error, row.prompt_tokens, time.time())
