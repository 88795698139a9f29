"""OpenAI Batch request files (`input.format: openai-batch`): each line a request {custom_id, method, url, body}, as
OpenAI's Batch API and `vllm run-batch` take them, mapped onto a batchgen row: the prompt (chat `messages`, or a
completion's `prompt`, an embedding's `input`) and the per-row sampling columns.

A batch serves one endpoint, as OpenAI's does: `/v1/chat/completions`, `/v1/completions` or `/v1/embeddings`, the
one its first request names (`first_endpoint`: run-batch picks the job's task by it, embed for embeddings). A request
batchgen cannot serve as asked (another endpoint; a body key it does not support with a value other than the
default; a malformed body) is that request's error, not the job's. An embeddings request embeds one input, a string
or a list of token ids: a list of several strings is that request's error (one line, one row, one response).
The body's `model` is not checked: the job's model answers every request, and the output names it; where the job has
LoRA adapters (`lora:`, run-batch's --lora-modules), a `model` that names one has that adapter answer, as vLLM does."""
from __future__ import annotations

import json
from typing import Any, Iterable

import pyarrow as pa

from .staged_columns import INPUT_ERROR_COLUMN, MESSAGES_TYPE

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)
ENCODING_FORMATS = ("float", "base64")
# The staged file's columns: fixed, whatever the requests hold
SCHEMA = pa.schema([("custom_id", pa.string()), ("url", pa.string()), ("model", pa.string()),
                    ("messages", MESSAGES_TYPE), ("prompt", pa.string()), ("max_tokens", pa.int64()),
                    ("temperature", pa.float64()), ("top_p", pa.float64()), ("seed", pa.int64()),
                    ("n", pa.int64()), ("stop", pa.list_(pa.string())), ("logprobs", pa.int64()),
                    ("presence_penalty", pa.float64()), ("frequency_penalty", pa.float64()),
                    ("json_schema", pa.string()), ("prompt_token_ids", pa.list_(pa.int64())),
                    ("encoding_format", pa.string()), ("dimensions", pa.int64()), (INPUT_ERROR_COLUMN, pa.string())])
NUMBERS = {"temperature": "temperature", "top_p": "top_p", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
INTEGERS = {"seed": "seed", "n": "n"}
# Keys whose default value asks nothing of batchgen: accepted at that value (or null), refused at any other.
DEFAULTS = {"stream": False, "logit_bias": None, "tools": None, "tool_choice": None, "functions": None,
            "function_call": None, "parallel_tool_calls": None, "echo": False, "best_of": 1, "suffix": None,
            "audio": None, "modalities": None, "prediction": None, "reasoning_effort": None, "service_tier": None,
            "web_search_options": None, "stream_options": None}
IGNORED = ("model", "user", "metadata", "store")  # recorded or meaningless here: never an error
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class Unsupported(ValueError):
    """Why batchgen cannot serve a request as asked."""


class BatchEndpoint:
    """The batch's endpoint: the first request's (OpenAI's Batch API takes one per batch)."""

    def __init__(self) -> None:
        self.url: str | None = None

    def row(self, request: dict[str, Any], line: int | None = None) -> dict[str, Any]:
        """The request as a row's values; a request that cannot be served has only its custom_id and its error
        (naming its `line` of the file, where given)."""
        custom_id = request.get("custom_id")
        row: dict[str, Any] = {"custom_id": custom_id_text(custom_id),
                               "url": request.get("url") if isinstance(request.get("url"), str) else None}
        try:
            if not isinstance(custom_id, str) or not custom_id:
                raise Unsupported("custom_id must be a non-empty string" +
                                  (f", got {row['custom_id']}" if custom_id not in (None, "") else ""))
            url, body = request.get("url"), request.get("body")
            if request.get("method", "POST") != "POST":
                raise Unsupported(f"method must be POST, got {request.get('method')!r}")
            if url not in ENDPOINTS:
                raise Unsupported(f"batchgen serves {CHAT}, {COMPLETIONS} and {EMBEDDINGS}, not {url!r}")
            self.url = self.url or url
            if url != self.url:
                raise Unsupported(f"this batch's endpoint is {self.url} (its first request's), not {url!r}; a batch "
                                  f"serves one endpoint, as OpenAI's Batch API does")
            if not isinstance(body, dict):
                raise Unsupported("body must be a JSON object")
            row.update(embedding_values(body) if url == EMBEDDINGS else body_values(body, url))
        except Unsupported as exc:
            where = f"line {line}: " if line is not None else ""
            return {"custom_id": row["custom_id"], "url": row["url"], INPUT_ERROR_COLUMN: f"{where}{exc}"}
        return row


def first_endpoint(requests: Iterable[Any]) -> str | None:
    """The batch's endpoint as staging finds it: that of the first request served (None: no request is)."""
    endpoint = BatchEndpoint()
    for request in requests:
        if isinstance(request, dict):
            endpoint.row(request)
            if endpoint.url is not None:
                return endpoint.url
    return None


def custom_id_text(value: Any) -> str | None:
    """A request's custom_id as its output line carries it: a string as it is, any other value as its JSON text
    (`17` is "17"), so that the line of a request refused for it can still be found."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def body_values(body: dict[str, Any], url: str) -> dict[str, Any]:
    values: dict[str, Any] = {"model": body.get("model") if isinstance(body.get("model"), str) else None}
    known = {"messages", "prompt", "max_tokens", "max_completion_tokens", "stop", "logprobs", "top_logprobs",
             "response_format", *NUMBERS, *INTEGERS, *DEFAULTS, *IGNORED}
    unknown = sorted(key for key in body if key not in known)
    if unknown:
        raise Unsupported(f"body key {unknown[0]!r} is not supported")
    for key, default in DEFAULTS.items():
        if body.get(key, default) not in (default, None):
            raise Unsupported(f"body key {key!r} is not supported (only {json.dumps(default)})")
    if url == CHAT:
        values["messages"] = _messages(body.get("messages"))
        if "prompt" in body:
            raise Unsupported("a chat request takes messages, not prompt")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise Unsupported("prompt must be a string (one prompt per request)")
        values["prompt"] = prompt
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        values["max_tokens"] = _number(limit, "max_tokens", int)
    for key, column in NUMBERS.items():
        if body.get(key) is not None:
            values[column] = float(_number(body[key], key, float))
    for key, column in INTEGERS.items():
        if body.get(key) is not None:
            values[column] = _number(body[key], key, int)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise Unsupported("stop must be a string or a list of strings")
        values["stop"] = stop
    values["logprobs"] = _logprobs(body, url)
    values["json_schema"] = _response_format(body.get("response_format"))
    return values


def embedding_values(body: dict[str, Any]) -> dict[str, Any]:
    """An embeddings request: {model, input, encoding_format?, dimensions?, user?} (OpenAI's body)."""
    known = ("input", "encoding_format", "dimensions", *IGNORED)
    unknown = sorted(key for key in body if key not in known)
    if unknown:
        raise Unsupported(f"body key {unknown[0]!r} is not supported")
    values: dict[str, Any] = {"model": body.get("model") if isinstance(body.get("model"), str) else None}
    text = body.get("input")
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], (str, list)):
        text = text[0]  # a list of one input: that input
    if isinstance(text, str):
        if not text:
            raise Unsupported("input must not be empty")
        values["prompt"] = text
    elif isinstance(text, list) and text and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        if any(t < 0 for t in text):
            raise Unsupported("input's token ids must be non-negative")
        values["prompt_token_ids"] = text
    elif isinstance(text, list) and len(text) > 1 and all(isinstance(t, (str, list)) for t in text):
        raise Unsupported(f"input holds {len(text)} inputs; batchgen embeds one input per request line (a string or "
                          f"a list of token ids): write one line per input")
    else:
        raise Unsupported("input must be a non-empty string or a non-empty list of token ids")
    encoding = body.get("encoding_format")
    if encoding is not None:
        if encoding not in ENCODING_FORMATS:
            raise Unsupported(f"encoding_format must be float or base64, got {encoding!r}")
        values["encoding_format"] = encoding
    if body.get("dimensions") is not None:
        values["dimensions"] = _number(body["dimensions"], "dimensions", int)
        if values["dimensions"] < 1:
            raise Unsupported("dimensions must be at least 1")
    return values


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise Unsupported("messages must be a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise Unsupported(f"a message's role must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise Unsupported("only text content parts are supported")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise Unsupported("a message's content must be text")
        out.append({"role": ROLES[message["role"]], "content": content})
    return out


def _number(value: Any, key: str, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise Unsupported(f"{key} must be {'an integer' if kind is int else 'a number'}")
    return int(value) if kind is int else value


def _logprobs(body: dict[str, Any], url: str) -> int | None:
    """batchgen's per-token logprobs count: chat's logprobs (bool) with top_logprobs; completions' logprobs (int)."""
    if url == COMPLETIONS:
        return None if body.get("logprobs") is None else _number(body["logprobs"], "logprobs", int)
    if body.get("logprobs") in (None, False):
        if body.get("top_logprobs") is not None:
            raise Unsupported("top_logprobs needs logprobs: true")
        return None
    if body["logprobs"] is not True:
        raise Unsupported("logprobs must be true or false")
    return _number(body.get("top_logprobs") or 0, "top_logprobs", int)


def _response_format(value: Any) -> str | None:
    """response_format as sampling.json_schema's text: json_object any JSON object, json_schema its schema."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise Unsupported("response_format json_schema needs json_schema.schema, an object")
        return json.dumps(schema)
    raise Unsupported(f"response_format type must be text, json_object or json_schema, got {kind!r}")
