"""`batchgen run-batch -i requests.jsonl -o results.jsonl`: the command line `vllm run-batch` users type, as a batchgen
job. The job reads the OpenAI Batch file (input.format: openai-batch) and writes OpenAI Batch output
(output.format: openai-batch) into a work directory beside the results, `results.jsonl.batchgen/`, with every
guarantee of `batchgen run` (its ledger: the same command resumes a killed run; its `_report.html`); once it is
finished, its parts are joined into `-o` (requests answered) and `results.errors.jsonl` (requests that failed, as
OpenAI writes an error file), each written whole or not at all.

The job's task follows the batch's endpoint, that of its first request (openai_batch.first_endpoint, as staging
reads it): `/v1/embeddings` runs `task: embed`, the others generate. A request for another endpoint than the
batch's is that request's error in the errors file, as OpenAI's Batch API takes one endpoint a batch."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from .input.openai_batch import EMBEDDINGS, first_endpoint
from .keys import JobConfigError
from .output.parts import FINAL_PART

WORK_SUFFIX = ".batchgen"
# As OpenAI's and vLLM's endpoints: a request without a temperature samples at 1.0, and one without max_tokens
# generates until it stops or the context ends (batchgen's jobs default to 0 and 256).
RUN_BATCH_SAMPLING = {"temperature": 1.0, "max_tokens": None}
# An embeddings request's own keys its response needs, kept beside `url` from the staged input (openai_batch.py)
EMBEDDING_KEEP_COLUMNS = ["encoding_format", "dimensions"]


def batch_job(requests: str, results: str, model: str, lora_modules: tuple[str, ...] = ()) -> dict[str, Any]:
    """The raw job of a run-batch command (--set overrides apply to it like to a job file); `lora_modules`:
    NAME=ADAPTER items, the job's `lora:` map."""
    output = {"path": work_dir(results), "format": "openai-batch"}
    job: dict[str, Any] = {"model": model, "input": {"path": requests, "format": "openai-batch"}}
    if lora_modules:
        job["lora"] = lora_map(lora_modules)
    if batch_endpoint(requests) == EMBEDDINGS:
        return job | {"task": "embed", "output": output | {"keep_columns": list(EMBEDDING_KEEP_COLUMNS)}}
    return job | {"sampling": dict(RUN_BATCH_SAMPLING), "output": output}


def lora_map(items: tuple[str, ...]) -> dict[str, str]:
    adapters = {}
    for item in items:
        name, _, adapter = item.partition("=")
        if not name.strip() or not adapter.strip():
            raise JobConfigError(f"--lora-modules: expected NAME=ADAPTER, got {item!r}")
        if name in adapters:
            raise JobConfigError(f"--lora-modules: adapter name {name!r} given twice")
        adapters[name.strip()] = adapter.strip()
    return adapters


def batch_endpoint(requests: str) -> str | None:
    """The endpoint of the request file's first request batchgen serves; None where there is none or the file
    cannot be read here (the job then reads it, and says why)."""
    try:
        return first_endpoint(_requests(requests))
    except Exception:  # unreadable here (a store's credentials, a damaged file): the job reads it and says why
        return None


def _requests(requests: str) -> Iterator[Any]:
    from batchgen.object_store import StorageConfig, is_remote, list_input

    from .input.text_lines import numbered_lines

    names = (".jsonl", ".jsonl.gz")  # an input folder's request files, first in sorted order as the job reads them
    if is_remote(requests):
        found = list_input(requests, StorageConfig(), names=names)
        source: Any = found[0] if found else None
    else:
        path = Path(requests).expanduser()
        found = sorted(p for p in path.rglob("*") if p.name.lower().endswith(names) and not any(
            part.startswith((".", "_")) for part in p.relative_to(path).parts)) if path.is_dir() else [path]
        source = found[0] if found else None
    if source is None:
        return
    for line in numbered_lines(source):
        if line.text.strip():
            try:
                yield json.loads(line.text)
            except ValueError:
                yield None


def work_dir(results: str) -> str:
    if results.startswith("s3://"):
        raise JobConfigError(f"-o: {results}: run-batch writes a local file; for object storage, run a job with "
                             f"output.format: openai-batch")
    return str(Path(results).expanduser()) + WORK_SUFFIX


def errors_path(results: str) -> Path:
    path = Path(results).expanduser()
    stem = path.name[:-len(".jsonl")] if path.name.endswith(".jsonl") else path.name
    return path.with_name(f"{stem}.errors.jsonl")


def assemble(results: str, summary: dict) -> tuple[Path, Path | None]:
    """Join the finished job's parts into the results file and, where requests failed, the errors file (each
    through a scratch file renamed into place). Returns their paths."""
    work = Path(work_dir(results))
    parts = [name for name in summary.get("parts", []) if FINAL_PART.fullmatch(name)]
    target, errors = Path(results).expanduser(), errors_path(results)
    _join(sorted(work / name for name in parts if name.startswith("part-")), target)
    failed = sorted(work / name for name in parts if name.startswith("errors-"))
    if failed:
        _join(failed, errors)
    else:
        errors.unlink(missing_ok=True)  # an earlier, failed run's
    return target, errors if failed else None


def _join(sources: list[Path], target: Path) -> None:
    scratch = target.with_name(f".{target.name}.inprogress")
    with open(scratch, "wb") as out:
        for source in sources:
            with open(source, "rb") as part:
                while chunk := part.read(1 << 20):
                    out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    os.replace(scratch, target)
