"""executor.kind: local — one engine in this process (open_engine: an Engine, or an EncoderEngine for a BERT-family
encoder): the rows stream from the source into the engine's public request API (`generate`) and each row's results
into the sink as they finish."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from batchgen.engine import Request, Result, SamplingParams
from batchgen.engine.errors import SettingError

from ..config import JobConfigError, setting_error
from ..input.source import SourceRow, read_source
from ..output.part_writer import PartWriter
from ..prepare import PreparedJob, check_chat_template, engine_args_for
from .base import ExecutorRun, error_result, result_groups


class LocalExecutor:
    def run(self, job: PreparedJob, sink: PartWriter, on_row: Callable[[list[Result]], None],
            on_start: Callable[[], None], on_stats: Callable[[str, Any], None]) -> ExecutorRun:
        engine = load_engine(job)
        on_start()
        config = job.config
        rows = read_source(config, job.inputs, engine.tokenizer, engine.max_model_len, job.done,
                           context_limit=getattr(engine, "context_limit", None))

        sample = lambda: on_stats("engine", engine.stats)
        sample()  # before the first step: the counters' zero, so the first interval has a rate too
        stream_rows(rows, lambda requests: engine.generate(requests, on_step=sample), sink, on_row,
                    json_schema=config.sampling.json_schema)
        return ExecutorRun(engine_stats=engine.stats())


def load_engine(job: PreparedJob):
    import batchgen.engine
    from batchgen.models import ModelError

    from ..calibration import calibrated_args

    rows_left = job.done.count(0) if job.done is not None else job.config.engine.max_num_seqs
    try:
        args = calibrated_args(job, engine_args_for(job.config, rows_left, job.model, job.adapters))
        engine = batchgen.engine.open_engine(args)
    except ModelError as exc:  # e.g. an architecture we do not support: a problem with the job, not a crash
        raise JobConfigError(f"model: {exc}") from None
    except SettingError as exc:  # a setting the engine cannot honour, e.g. a KV cache too small for the model
        raise setting_error(exc, "engine") from None
    check_chat_template(job.config, engine.tokenizer)
    return engine


def stream_rows(rows: Iterable[SourceRow], generate: Callable[[Iterator[Request]], Iterable[Result]],
                writer: PartWriter, on_row: Callable[[list[Result]], Any] = lambda results: None,
                json_schema: str | None = None) -> None:
    """Feed rows to `generate` lazily and write every row's results. Error rows skip the engine: their error result is
    written as they are pulled. A request of n samples gives n results (sample_index 0..n-1, the engine returns them
    together), or one error result: they are written as one group, so that no part holds only some of a row's
    samples. Only the requests inside the engine are remembered. `json_schema`: the job's, with output.parse_json
    (rows under another constraint are not parsed)."""
    in_engine: dict[int, tuple[Any, tuple, SamplingParams]] = {}  # row -> (id, kept values, sampling)

    def requests() -> Iterator[Request]:
        for row in rows:
            if row.error is not None:
                result = error_result(row)
                writer.add(row.row, row.id, row.keep, result)
                on_row([result])
                continue
            in_engine[row.row] = (row.id, row.keep, row.sampling)
            yield Request(row.row, row.token_ids, row.sampling, pooling_params=row.pooling, lora=row.lora)

    for group in result_groups(generate(requests()), lambda row: in_engine[row][2].n):
        ident, keep, sampling = in_engine.pop(group[0].request_id)
        writer.add(group[0].request_id, ident, keep, *group, parse_json=sampling.json_schema == json_schema)
        on_row(group)
