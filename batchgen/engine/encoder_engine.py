"""The engine for an encoder model (BERT family) and the embed and classify tasks: Engine's public API (add_request,
step, abort, has_unfinished, generate, stats) over prefill-only requests. No KV cache, no scheduler: each step takes
a batch of waiting requests, runs one forward and returns all their Results.

A step's batch: the waiting requests sorted by length, the run of them around the oldest (so none waits forever)
grown shorter-first while it fits `max_num_batched_tokens` (its tokens; on the padded generic path, its rows x its
longest row) and `max_num_seqs`. On the native path a row's embedding is the same bits whatever batch it ran in
(models/bert.py), so a resumed job's rows match an uninterrupted run's."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.machine import process_rss

from ..models.encoder_model import NATIVE, EncoderModel, encoder_path
from ..models.encoder_pooling import classification, finish_embeddings
from ..models.encoder_support import EncoderDescription, describe_encoder
from ..models.loader import load_tokenizer, resolve_model
from ..models.registry import ModelError
from .engine_args import EngineArgs
from .cpu_features import DtypeChoice
from .engine_plan import EngineTarget, resolve_target
from .errors import SettingError
from .output_processor import Clock
from .process_memory import peak_rss_bytes
from .request import POOLINGS, PoolingParams, Request, Result
from .request_stream import stream_results
from .scheduler import StepStats
from .step_times import StepTimes

ENCODER_TASKS = ("embed", "classify")


@dataclass(frozen=True)
class EncoderPlan:
    """The encoder engine's start-up decisions (EnginePlan's counterpart: no KV cache, no attention kernels)."""

    model: EncoderDescription
    target: EngineTarget
    path: str  # native (models/bert.py) or generic (transformers' code)
    task: str
    max_model_len: int  # a prompt is cut to this many tokens (or refused, truncate: false)
    context_limit: str  # where that limit comes from

    @property
    def device(self):
        return self.target.device

    @property
    def dtype(self):
        return self.target.dtype


@dataclass
class _Pending:
    request: Request
    ids: list[int]  # the tokens that run: cut to max_model_len
    truncated: int  # tokens cut
    pooling: str
    normalize: bool
    dimensions: int | None
    arrival: float  # monotonic


class EncoderEngine:
    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        if args.task not in ENCODER_TASKS:
            raise SettingError("task", f"task {args.task} needs a decoder; {args.model} is an encoder model (BERT "
                                       f"family), which runs task embed or classify")
        if args.quantization is not None:
            raise SettingError("quantization", "quantization is for decoder models; an encoder runs unquantized")
        self.args = args
        model_dir = resolve_model(args.model)
        try:
            description = describe_encoder(model_dir)
        except ValueError as exc:  # UnsupportedModelError: a layout the engine cannot run
            raise ModelError(str(exc)) from None
        path = encoder_path(description, args.model_impl)
        if args.model_impl == "native" and path != NATIVE:
            raise SettingError("model_impl", f"model_impl native: batchgen has no native {description.architecture} "
                                             f"(native encoders: BERT, RoBERTa, XLM-RoBERTa, CamemBERT)")
        target = encoder_target(args, path)
        if args.task == "classify" and not description.has_classifier:
            raise SettingError("task", f"task classify needs a classification head (a *ForSequenceClassification "
                                       f"checkpoint); {args.model} is {description.architecture}: use task embed")
        self.tokenizer = load_tokenizer(model_dir)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.model = EncoderModel(model_dir, description, target.dtype.dtype, args.task == "classify",
                                  0 if pad is None else pad, args.batch_invariant, args.model_impl, target.device)
        limit = min(description.max_length, args.max_model_len or description.max_length)
        why = (f"engine.max_model_len is {limit} tokens" if limit == args.max_model_len else
               f"the model's maximum length is {limit} tokens ({description.max_length_source})")
        self.plan = EncoderPlan(description, target, self.model.path, args.task, limit, why)
        self.description, self.device = description, target.device
        self.dtype, self.dtype_reason = target.dtype.dtype, target.dtype.reason
        self.max_model_len, self.context_limit = limit, why
        self.vocab_size = self.model.vocab_size
        self.num_parameters, self.weights_bytes = description.parameters, self.model.weights_bytes()
        self.eos_token_ids: list[int] = []
        self.kv_capacity = 0
        self._end_tokens = set(getattr(self.tokenizer, "all_special_ids", None) or [])
        self._clock = Clock()
        self._waiting: list[_Pending] = []  # in arrival order
        self._ids: set[Any] = set()  # request ids waiting
        self._rejected: list[Result] = []
        self.num_steps = 0
        self.num_results = 0
        self.num_prompt_tokens = 0
        self.num_truncated_tokens = 0
        self.step_times = StepTimes()
        self.last_step: StepStats | None = None

    # -- the public request API --------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. One that cannot run (an empty or out-of-vocabulary prompt, one too long with truncate
        false, invalid pooling parameters) is not raised: its error Result comes out of the next step()."""
        if request.request_id in self._ids:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        now = time.monotonic()
        pending = self._admit(request, now)
        if isinstance(pending, str):
            ids = request.prompt_token_ids
            self._rejected.append(Result.for_error(request.request_id, pending, len(ids) if ids else 0,
                                                   self._clock.wall(now)))
            return
        self._waiting.append(pending)
        self._ids.add(request.request_id)

    def step(self) -> list[Result]:
        """Run one batch of waiting requests; returns its Results after the error results of requests added since
        the last step ([] when there is nothing to do)."""
        results, self._rejected = self._rejected, []
        self.num_results += len(results)
        if not self._waiting:
            return results
        started = time.perf_counter()
        scheduled = time.monotonic()
        batch = self._take_batch()
        rows = [pending.ids for pending in batch]
        if self.args.task == "embed":
            pooled = self.model.embed(rows, [pending.pooling for pending in batch])
            outputs = [{"embedding": vector} for vector in finish_embeddings(
                pooled, [p.normalize for p in batch], [p.dimensions for p in batch])]
        else:
            outputs = [{"probs": probs, "label": label, "score": score}
                       for probs, label, score in classification(self.model.logits(rows), self.description)]
        finish = self._clock.wall(time.monotonic())
        for pending, output in zip(batch, outputs):
            self._ids.discard(pending.request.request_id)
            results.append(Result(
                request_id=pending.request.request_id, text="", token_ids=[], finish_reason="stop", error=None,
                prompt_tokens=len(pending.ids), output_tokens=0, cached_tokens=0, num_preemptions=0,
                arrival_time=self._clock.wall(pending.arrival), first_scheduled_time=self._clock.wall(scheduled),
                first_token_time=finish, finish_time=finish, num_truncated_tokens=pending.truncated, **output))
        tokens = sum(map(len, rows))
        self.num_steps += 1
        self.num_results += len(batch)
        self.num_prompt_tokens += tokens
        self.num_truncated_tokens += sum(p.truncated for p in batch)
        self.last_step = StepStats(len(batch), 0, tokens, 0)
        self.step_times.observe(time.perf_counter() - started, len(batch), tokens)
        return results

    def abort(self, request_id: Any) -> bool:
        """Drop a waiting request; it yields no Result. False if it is unknown (or already returned)."""
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        self._waiting = [p for p in self._waiting if p.request.request_id != request_id]
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._rejected)

    def generate(self, requests: Iterable[Request], on_step: Callable[[], None] | None = None) -> Iterator[Result]:
        """Yield a Result for every request, in completion order; `requests` is pulled lazily, while fewer than
        max_num_seqs requests wait. on_step(): called after each step."""
        return stream_results(self, requests, lambda: len(self._waiting) + len(self._rejected),
                              self.args.max_num_seqs, on_step)

    def stats(self) -> dict:
        """Engine.stats()'s keys, the KV cache's zero (an encoder keeps none), and the prompt tokens run and cut."""
        kv_zero = ("kv_cache_tokens", "kv_pool_blocks", "kv_pool_bytes", "kv_block_bytes", "kv_blocks_in_use",
                   "kv_peak_blocks_used", "kv_peak_bytes_used", "kv_blocks_touched", "kv_bytes_touched",
                   "kv_local_pool_blocks", "kv_local_block_bytes", "kv_local_blocks_in_use",
                   "kv_local_peak_blocks_used", "kv_local_blocks_touched")
        return {
            "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0, "num_preemptions": 0,
            "num_steps": self.num_steps, **self.step_times.stats(), "num_results": self.num_results,
            "num_sampled_tokens": 0, "num_running": 0, "num_waiting": len(self._waiting),
            "dtype": str(self.dtype).removeprefix("torch."), "dtype_reason": self.dtype_reason,
            "model_path": self.plan.path, "architecture": self.description.architecture,
            "attention_backend": "torch",
            "attention_backend_reason": "an encoder's bidirectional attention: torch SDPA",
            "weights_bytes": self.weights_bytes, "kv_pool_reason": "an encoder model keeps no KV cache",
            **dict.fromkeys(kv_zero, 0), "kv_local_window": None,
            "task": self.args.task, "num_prompt_tokens": self.num_prompt_tokens,
            "num_truncated_tokens": self.num_truncated_tokens,
            "peak_memory_bytes": peak_rss_bytes(), "rss_bytes": process_rss(),
        }

    # -- admission and batching ---------------------------------------------------------------------------------------

    def _admit(self, request: Request, now: float) -> _Pending | str:
        """The request as it will run, or why it cannot."""
        params = request.pooling_params if request.pooling_params is not None else PoolingParams()
        problem = _check_params(params, self.description.embedding_dimension)
        if problem is not None:
            return f"invalid pooling parameters: {problem}"
        ids = request.prompt_token_ids
        if ids is None or len(ids) == 0:
            return "empty prompt: it has no tokens"
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            return f"prompt token ids must be integers in [0, {self.vocab_size})"
        limit, truncated = self.max_model_len, max(0, len(ids) - self.max_model_len)
        if truncated and not params.truncate:
            return f"prompt is too long: {len(ids)} tokens, and {self.context_limit} (truncate is false)"
        if truncated:  # as the tokenizer truncates: the end special token ([SEP], </s>) kept
            ids = list(ids[:limit - 1]) + [ids[-1]] if ids[-1] in self._end_tokens else list(ids[:limit])
        pooling = params.pooling or self.description.pooling
        normalize = params.normalize if params.normalize is not None else \
            (self.description.normalize or not self.description.sentence_transformers)
        return _Pending(request, list(ids), truncated, pooling, normalize, params.dimensions, now)

    def _take_batch(self) -> list[_Pending]:
        waiting = self._waiting
        order = sorted(range(len(waiting)), key=lambda i: (len(waiting[i].ids), i))
        low = high = order.index(0)  # the oldest request always runs
        budget, padded = self.args.max_num_batched_tokens, self.model.pads_rows
        tokens = len(waiting[order[low]].ids)

        def fits(extra: int, longest: int) -> bool:
            rows = high - low + 2
            return (rows * longest if padded else tokens + extra) <= budget

        while high - low + 1 < self.args.max_num_seqs:
            if low > 0 and fits(len(waiting[order[low - 1]].ids), len(waiting[order[high]].ids)):
                low -= 1
                tokens += len(waiting[order[low]].ids)
            elif high + 1 < len(order) and fits(len(waiting[order[high + 1]].ids), len(waiting[order[high + 1]].ids)):
                high += 1
                tokens += len(waiting[order[high]].ids)
            else:
                break
        chosen = set(order[low:high + 1])
        self._waiting = [p for i, p in enumerate(waiting) if i not in chosen]
        return [waiting[i] for i in order[low:high + 1]]


def encoder_target(args: EngineArgs, path: str) -> EngineTarget:
    """The engine's device and dtype rule (engine_plan.resolve_target), but for `auto` on the generic path, fp32:
    transformers' code in bf16 runs every op in bf16 (all-MiniLM-L6-v2 through it: cosine 0.99988 against fp32),
    where the native path keeps the residual stream and norms in fp32 (0.99997)."""
    target = resolve_target(args.device, args.dtype)
    if args.dtype == "auto" and path != NATIVE and target.dtype.dtype != torch.float32:
        return EngineTarget(target.device, DtypeChoice(torch.float32, "float32: auto for an encoder on transformers' "
                                                                      "code (bf16 there loses embedding accuracy)"))
    return target


def _check_params(params: PoolingParams, dimension: int) -> str | None:
    if params.pooling is not None and params.pooling not in POOLINGS:
        return f"pooling must be one of {', '.join(POOLINGS)}, got {params.pooling!r}"
    if params.normalize is not None and not isinstance(params.normalize, bool):
        return f"normalize must be true or false, got {params.normalize!r}"
    if not isinstance(params.truncate, bool):
        return f"truncate must be true or false, got {params.truncate!r}"
    if params.dimensions is not None and (not isinstance(params.dimensions, int) or isinstance(params.dimensions, bool)
                                          or not 1 <= params.dimensions <= dimension):
        return f"dimensions must be an integer in [1, {dimension}] (the model's embedding dimension), got " \
               f"{params.dimensions!r}"
    return None
