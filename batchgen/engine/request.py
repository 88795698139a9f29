"""The engine's public data: what goes in (Request, SamplingParams) and what comes out (Result)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import SettingError

MAX_N = 128  # samples per request
TASKS = ("generate", "embed", "classify", "score")  # EngineArgs.task: what a request returns
POOLINGS = ("mean", "cls", "last")  # PoolingParams.pooling
MAX_LOGPROBS = 20  # top alternatives per output token (vLLM's default cap)
CONSTRAINT_KEYS = ("choice", "regex", "json_schema", "grammar")


@dataclass
class SamplingParams:
    """Per-request sampling settings, with vLLM's names and meanings."""

    max_tokens: int | None = 16  # None: until the context ends (max_model_len), as OpenAI's endpoints without it
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = 1  # samples of this prompt: one prefill, its KV blocks shared by the samples
    logprobs: int | None = None  # per output token its logprob and this many top alternatives (vLLM's meaning)
    # Constrained output, at most one of them (structured.py):
    choice: list[str] = field(default_factory=list)  # the output is exactly one of these, scored, not decoded
    regex: str | None = None  # the output fully matches this regular expression
    json_schema: str | None = None  # the output is JSON valid under this schema (its JSON text)
    grammar: str | None = None  # the output is in this EBNF grammar (xgrammar's dialect, GBNF-like)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.choice = list(self.choice or [])

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(key, text) of the grammar that constrains decoding (regex, json_schema or grammar), or None. `choice`
        is not decoded under a grammar but scored."""
        for key in CONSTRAINT_KEYS[1:]:
            value = getattr(self, key)
            if value is not None:
                return key, value
        return None

    def validate(self) -> None:
        """Raise SettingError for the first invalid field."""

        def num(name: str, value: Any, kind: type) -> None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok and isinstance(value, float):  # ints stay ints: float() of a huge one overflows
                ok = math.isfinite(value) and (kind is float or value.is_integer())
            if not ok:
                raise SettingError(name, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")

        if self.max_tokens is not None:
            num("max_tokens", self.max_tokens, int)
            if self.max_tokens < 1:
                raise SettingError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        num("temperature", self.temperature, float)
        if self.temperature < 0:
            raise SettingError("temperature", f"temperature must be >= 0, got {self.temperature}")
        num("top_p", self.top_p, float)
        if not 0.0 < self.top_p <= 1.0:
            raise SettingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        num("top_k", self.top_k, int)
        if self.top_k < -1:
            raise SettingError("top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        num("min_p", self.min_p, float)
        if not 0.0 <= self.min_p <= 1.0:
            raise SettingError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        num("repetition_penalty", self.repetition_penalty, float)
        if self.repetition_penalty <= 0:
            raise SettingError("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            num(name, value, float)
            if not -2.0 <= value <= 2.0:
                raise SettingError(name, f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            num("seed", self.seed, int)
        num("min_tokens", self.min_tokens, int)
        if not 0 <= self.min_tokens <= (math.inf if self.max_tokens is None else self.max_tokens):
            raise SettingError("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise SettingError("stop", f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise SettingError("stop_token_ids",
                               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        num("n", self.n, int)
        if not 1 <= self.n <= MAX_N:
            raise SettingError("n", f"n must be in [1, {MAX_N}], got {self.n}")
        if self.logprobs is not None:
            num("logprobs", self.logprobs, int)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise SettingError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self._validate_constraint()

    def _validate_constraint(self) -> None:
        set_keys = [key for key in CONSTRAINT_KEYS if getattr(self, key) not in (None, [])]
        if len(set_keys) > 1:
            raise SettingError(set_keys[1], f"set at most one of {', '.join(CONSTRAINT_KEYS)}; got "
                                            f"{' and '.join(set_keys)}")
        if not isinstance(self.choice, list) or not all(isinstance(c, str) and c for c in self.choice):
            raise SettingError("choice", f"choice must be a list of non-empty strings, got {self.choice!r}")
        if len(set(self.choice)) != len(self.choice):
            raise SettingError("choice", "choice lists a string twice")
        for key in CONSTRAINT_KEYS[1:]:
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise SettingError(key, f"{key} must be a non-empty string, got {value!r}")
        if self.constraint is not None:
            from .structured import check_constraint
            check_constraint(*self.constraint)  # SettingError naming the key: malformed, or no grammar library


@dataclass
class PoolingParams:
    """A prefill-only request's settings (vLLM's name), for an engine whose task (EngineArgs.task) is embed,
    classify or score: it runs the prompt once and returns what these ask for instead of generated tokens. The
    fields of the engine's task apply; the others are ignored."""

    # embed
    pooling: str | None = None  # mean | cls | last; None: the model's own (its sentence-transformers Pooling
    # config), else mean for an encoder and last for a decoder
    normalize: bool | None = None  # L2-normalize the embedding; None: the model's own (a Normalize module), else true
    dimensions: int | None = None  # keep the first this many dimensions (Matryoshka), before normalizing
    # embed and classify: a prompt longer than the model's maximum length is cut to it (the end special tokens kept,
    # as the tokenizer truncates); False makes it an error instead
    truncate: bool = True
    # score: the logprob of each token from index score_from on, given those before it (1: a whole text;
    # the context's length: its continuation)
    score_from: int = 1
    token_logprobs: bool = False  # score: return each scored token's logprob, not only their sum


@dataclass
class Request:
    """One prompt to complete. `request_id` is echoed back in its Result."""

    request_id: Any
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    pooling_params: PoolingParams | None = None  # an embed/classify/score engine's settings (None: the defaults)
    lora: str | None = None  # the LoRA adapter that answers (a name of EngineArgs.lora); None: the base model


@dataclass(kw_only=True)
class Result:
    """A finished request. Times are wall-clock epoch seconds, derived from one monotonic clock,
    so their differences are exact durations."""

    request_id: Any
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    num_preemptions: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    sample_index: int = 0  # which of the request's n samples (its results come out of one step, together)
    choice_probs: list[tuple[str, float]] | None = None  # with `choice`: each candidate and its probability
    choice_logprobs: list[float] | None = None  # with `choice`: each candidate's total logprob (tokens, then EOS)
    logprobs: list[float] | None = None  # with `logprobs`: each output token's logprob
    top_logprobs: list[list[tuple[str, int, float]]] | None = None  # per output token: (text, id, logprob)
    # What a prefill-only task returns (text and token_ids empty, output_tokens 0):
    embedding: list[float] | None = None  # embed: the pooled (cut, normalized) vector
    probs: list[float] | None = None  # classify: per label, in the model's id2label order (softmax, or sigmoid for a
    # multi-label or one-output head)
    label: str | None = None  # classify: the most probable label's name
    score: float | None = None  # classify with a one-output head (a reward model): its raw output
    prompt_logprobs: list[float] | None = None  # score: the logprob of each scored token, in order
    num_truncated_tokens: int = 0  # embed/classify: prompt tokens cut to fit the model's maximum length
    lora: str | None = None  # the LoRA adapter that answered (Request.lora); None: the base model

    @classmethod
    def for_error(cls, request_id: Any, message: str, prompt_tokens: int, now: float) -> "Result":
        """A request that never ran: no tokens, no timings but its arrival and finish at `now`. (Not named
        `error`: that is the field holding the message.)"""
        return cls(request_id=request_id, text="", token_ids=[], finish_reason="error", error=message,
                   prompt_tokens=prompt_tokens, output_tokens=0, cached_tokens=0, num_preemptions=0,
                   arrival_time=now, first_scheduled_time=None, first_token_time=None, finish_time=now)

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_time is None or self.output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        return self.finish_time - self.arrival_time
