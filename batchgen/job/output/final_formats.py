"""output.format: what the final rewrite writes for each table of the output (`rows_per_part` input positions, every
sample of a row together). `parquet` (the default): a Parquet part. `jsonl`: the output columns as JSON lines.
`openai-batch`: one line per request in OpenAI Batch output form — {id, custom_id, response: {status_code,
request_id, body}, error} — with the requests that failed in their own `errors-*.jsonl` files, as OpenAI writes an
error file; batchgen's timings ride along in a `batchgen` object on each line. An embeddings request's body is
OpenAI's list of one embedding (`encoding_format: base64`: its float32 bytes, little-endian, in base64). The run
parts, the ledger and `_SUCCESS` are the same for every format."""
from __future__ import annotations

import base64
import hashlib
import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Union

import pyarrow as pa

from .schema import ROW_COLUMN, SAMPLE_COLUMN

OUTPUT_FORMATS = ("parquet", "jsonl", "openai-batch")
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
# the extension object's fields: batchgen's own per-row figures, beside OpenAI's
TIMING_FIELDS = ("queue_s", "ttft_s", "tpot_s", "e2e_s", "arrival_time", "first_token_time", "finish_time",
                 "output_tokens", "cached_tokens", "num_preemptions", "replica")

FinalFile = tuple[str, Union[pa.Table, str]]  # a file's name, and its table (Parquet) or its text (JSON lines)


@dataclass(frozen=True)
class FinalFormat:
    kind: str = "parquet"
    model: str = ""  # openai-batch: the model named in each response
    chat: bool = True  # openai-batch, for rows without a request url: the job's endpoint (its chat template on)

    def files(self, table: pa.Table, index: int) -> list[FinalFile]:
        """The final files of one table (without `_row`): its part, and for openai-batch its errors, if any."""
        if self.kind == "parquet":
            return [(f"part-{index:05d}.parquet", table)]
        if self.kind == "jsonl":
            return [(f"part-{index:05d}.jsonl", "".join(_line(row) for row in table.to_pylist()))]
        responses, errors = batch_lines(table, self.model, self.chat)
        return [(f"part-{index:05d}.jsonl", responses)] + ([(f"errors-{index:05d}.jsonl", errors)] if errors else [])

    def empty(self, schema: pa.Schema) -> list[FinalFile]:
        return [(f"part-00000.{'parquet' if self.kind == 'parquet' else 'jsonl'}",
                 schema.empty_table() if self.kind == "parquet" else "")]


def _line(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=_plain, separators=(",", ":")) + "\n"


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"{type(value).__name__} is not JSON")


def batch_lines(table: pa.Table, model: str, chat: bool) -> tuple[str, str]:
    """(response lines, error lines) of the table's requests: a request is its id's rows (its n samples)."""
    responses, errors = [], []
    rows = table.to_pylist()
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and rows[end].get(SAMPLE_COLUMN, 0) > 0:
            end += 1  # the same request's next sample
        samples = rows[start:end]
        start = end
        first = samples[0]
        request_id = _request_id(first)
        line = {"id": f"batch_req_{request_id}", "custom_id": _custom_id(first["id"])}
        is_chat = first["url"] == CHAT if first.get("url") in (CHAT, COMPLETIONS) else chat
        try:
            error = _failure(first)
            # a request answered by a LoRA adapter names it, as vLLM's --lora-modules responses do
            body = _body(samples, first.get("lora") or model, is_chat, request_id) if error is None else None
        except EmbeddingRefused as exc:
            error = str(exc)
        if error is not None:
            line |= {"response": {"status_code": 400, "request_id": request_id, "body": {"error": {
                "message": error, "type": "invalid_request_error", "param": None, "code": None}}},
                "error": None}
            errors.append(_line(line | {"batchgen": _timings(first)}))
            continue
        line |= {"response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None,
                 "batchgen": _timings(first) | {"samples": [_timings(s) for s in samples]} if len(samples) > 1
                 else _timings(first)}
        responses.append(_line(line))
    return "".join(responses), "".join(errors)


class EmbeddingRefused(ValueError):
    """Why a request's embedding cannot be answered as asked (its line goes to the errors file)."""


def _failure(row: dict) -> str | None:
    """A failed row's error; a row of a task other than generate has no finish_reason, only its error. A request
    answered by a job of the other kind (an embeddings request in a job that generates, or the reverse) is refused."""
    failed = row["finish_reason"] == "error" if "finish_reason" in row else row.get("error") is not None
    if failed:
        return row.get("error") or "failed"
    if row.get("url") == EMBEDDINGS and "embedding" not in row:
        return f"{EMBEDDINGS} needs a job with task: embed (batchgen run-batch picks it for a file of embeddings)"
    if row.get("url") in (CHAT, COMPLETIONS) and "embedding" in row:
        return f"{row['url']} needs a job that generates (task: generate); this job's task is embed"
    return None


def _request_id(row: dict) -> str:
    """Stable across runs of the same output: from the row's id and its finish time."""
    seed = f"{row['id']}\0{row.get('finish_time')}"
    return hashlib.sha256(seed.encode()).hexdigest()[:24]


def _custom_id(ident: Any) -> Any:
    return ident if isinstance(ident, str) or ident is None else str(ident)


def _body(samples: list[dict], model: str, chat: bool, request_id: str) -> dict:
    if "embedding" in samples[0]:
        return _embedding_body(samples[0], model)
    finished = max(s["finish_time"] for s in samples)
    created = int(finished.replace(tzinfo=finished.tzinfo or timezone.utc).timestamp())
    choices = []
    for index, s in enumerate(samples):
        logprobs = _logprobs(s, chat)
        if chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": s["text"]},
                            "logprobs": logprobs, "finish_reason": s["finish_reason"]})
        else:
            choices.append({"index": index, "text": s["text"], "logprobs": logprobs,
                            "finish_reason": s["finish_reason"]})
    completion = sum(s["output_tokens"] for s in samples)
    prompt = samples[0]["prompt_tokens"]
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": choices, "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                          "total_tokens": prompt + completion,
                                          "prompt_tokens_details": {"cached_tokens": samples[0]["cached_tokens"]}}}


def _embedding_body(row: dict, model: str) -> dict:
    """OpenAI's embeddings response: one embedding. usage counts the tokens the model ran (after any cut to its
    maximum length). A request's `dimensions` the engine did not apply (the job's embed.dimensions is job-wide) keeps
    the first that many, normalized again where the whole vector was unit length, as the engine cuts (Matryoshka)."""
    vector = [float(value) for value in row["embedding"]]
    wanted = row.get("dimensions")
    if wanted is not None and wanted != len(vector):
        if wanted > len(vector):
            raise EmbeddingRefused(f"dimensions {wanted} is more than the model's {len(vector)}")
        unit = abs(math.fsum(v * v for v in vector) - 1.0) < 1e-3
        vector = vector[:wanted]
        norm = math.sqrt(math.fsum(v * v for v in vector))
        if unit and norm > 0:
            vector = [v / norm for v in vector]
    if row.get("encoding_format") == "base64":
        import numpy as np
        encoded: Any = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    else:
        encoded = vector
    tokens = row.get("prompt_tokens") or 0  # what ran, after the cut (output/schema.py)
    return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": encoded}], "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _logprobs(row: dict, chat: bool) -> dict | None:
    """OpenAI's logprobs of a choice. The sampled token's text is its own entry among the top alternatives where
    it is one of them (greedy: always), else null."""
    values, tops = row.get("logprobs"), row.get("top_logprobs")
    if values is None:
        return None
    tops = tops or [[] for _ in values]
    tokens = [next((alt["token"] for alt in alts if alt["logprob"] == value), None) for value, alts in zip(values, tops)]
    if chat:
        return {"content": [{"token": token, "logprob": value, "bytes": None,
                             "top_logprobs": [{"token": alt["token"], "logprob": alt["logprob"], "bytes": None}
                                              for alt in alts]}
                            for token, value, alts in zip(tokens, values, tops)]}
    return {"tokens": tokens, "token_logprobs": values,
            "top_logprobs": [{alt["token"]: alt["logprob"] for alt in alts} for alts in tops], "text_offset": None}


def _timings(row: dict) -> dict:
    return {name: (row[name].isoformat() if isinstance(row[name], datetime) else row[name])
            for name in TIMING_FIELDS if name in row}


def batch_rows(text: str) -> list[dict]:
    """The output rows' figures that OpenAI Batch lines (responses or errors, as batch_lines writes them) carry back:
    a row per sample, with its finish reason, error, tokens and the `batchgen` object's timings (what `batchgen
    report` reads of such an output)."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        request = json.loads(line)
        ours, body = request.get("batchgen") or {}, (request.get("response") or {}).get("body") or {}
        if "error" in body or request.get("error"):
            error = (body.get("error") or request.get("error") or {}).get("message")
            rows.append({**ours, "finish_reason": "error", "error": error, "prompt_tokens": 0, "output_tokens": 0})
            continue
        usage, choices = body.get("usage") or {}, body.get("choices") or []
        if body.get("object") == "list":  # an embedding: one row, no finish reason
            rows.append({**ours, "error": None, "prompt_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0})
            continue
        samples = ours.get("samples") or [ours]
        for choice, sample in zip(choices, samples):
            rows.append({**sample, "finish_reason": choice.get("finish_reason"), "error": None,
                         "prompt_tokens": usage.get("prompt_tokens", 0),
                         "output_tokens": sample.get("output_tokens", usage.get("completion_tokens", 0))})
    return rows


def without_row_column(table: pa.Table) -> pa.Table:
    return table.drop_columns([ROW_COLUMN]) if ROW_COLUMN in table.column_names else table
