"""The offline engine: pulls requests lazily, steps scheduler + model runner, yields results as they finish."""
from __future__ import annotations

import logging
import random
import resource
import time
from collections.abc import Iterable, Iterator

import torch

from ..model_loader import eos_token_ids, load_model, load_tokenizer, resolve_model
from .detokenizer import IncrementalDetokenizer, detokenize
from .cuda_graphs import DecodeGraphRunner, padded_decode_supported
from .engine_args import EngineArgs, parse_bytes
from .gpu_memory import kv_cache_budget
from .kv_cache_manager import KVCacheManager
from .model_runner import ModelRunner
from .request import Request, Result
from .scheduler import Scheduler
from .sequence import Sequence

logger = logging.getLogger("batchgen")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Clock:
    """Monotonic time for every measurement, turned into wall-clock timestamps through one fixed anchor."""

    def __init__(self) -> None:
        self._offset = time.time() - time.monotonic()

    def wall(self, monotonic: float | None) -> float | None:
        return None if monotonic is None else monotonic + self._offset


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        self.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                                   else "cpu" if args.device == "auto" else args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but torch sees no CUDA device")
        self.dtype = _DTYPES.get(args.dtype) or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.clock = Clock()
        self._seeds = random.Random(args.seed)

        model_dir = resolve_model(args.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir, self.dtype, self.device)
        self.eos_token_ids = eos_token_ids(model_dir, self.tokenizer)
        self.vocab_size = self.model.vocab_size

        num_blocks = self._num_kv_blocks()
        self.kv_capacity = num_blocks * args.block_size
        self.max_model_len = min(args.max_model_len or self.model.max_model_len, self.model.max_model_len,
                                 self.kv_capacity)
        self.kv_cache = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, args.max_num_seqs, args.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, num_blocks, args.block_size, self.dtype, self.device, self.eos_token_ids)
        if self.device.type == "cuda" and not args.enforce_eager:
            self._use_cuda_graphs()
        self._eos = set(self.eos_token_ids)
        self.num_steps = 0

    def _use_cuda_graphs(self) -> None:
        """Decode-only steps replay CUDA graphs, captured now for every bucketed batch size; eager if that fails."""
        if not padded_decode_supported(self.device):
            logger.warning("no CUDA graphs: they need the Triton attention kernels (is triton installed?)")
            return
        graphs = DecodeGraphRunner(self.model, self.args.block_size, self.args.max_num_seqs, self.max_model_len,
                                   self.device, capture=True)
        try:
            graphs.capture_all()
        except Exception as exc:  # noqa: BLE001 -- eager decoding gives the same tokens, only slower
            logger.warning("no CUDA graphs, decoding eagerly: capturing them failed: %s: %s", type(exc).__name__, exc)
            return
        self.runner.decode_graphs = graphs

    def _num_kv_blocks(self) -> int:
        m, args = self.model, self.args
        bytes_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * torch.finfo(self.dtype).bits // 8
        if args.kv_cache_memory is None and self.device.type == "cuda":
            # what is free after the weights and a profiling step, times the utilisation
            budget = kv_cache_budget(m, args.max_num_batched_tokens, args.max_num_seqs, args.block_size,
                                     args.gpu_memory_utilization)
            source = f"from gpu_memory_utilization {args.gpu_memory_utilization} ({max(budget, 0)} bytes)"
        else:
            budget, source = parse_bytes(args.cpu_kv_cache_memory()), repr(args.cpu_kv_cache_memory())
        num_blocks = budget // (bytes_per_token * args.block_size)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory {source} holds fewer than 2 blocks of "
                             f"{args.block_size} tokens ({bytes_per_token} bytes per token)")
        logger.info("KV cache: %d bytes/token (%d layers x 2 x %d kv heads x %d dims x %s), %d blocks of %d = %d tokens,"
                    " %.2f GiB", bytes_per_token, m.num_layers, m.num_kv_heads, m.head_dim, self.dtype, num_blocks,
                    args.block_size, num_blocks * args.block_size, num_blocks * args.block_size * bytes_per_token / 2**30)
        return num_blocks

    # -- the public loop -------------------------------------------------------------------------------------------

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Yield a Result for every request, in completion order. `requests` may be a lazy iterable of any length:
        a new one is pulled only while the waiting queue has room."""
        source = iter(requests)
        exhausted = False
        while True:
            while not exhausted and len(self.scheduler.waiting) < self.args.max_num_seqs:
                request = next(source, None)
                if request is None:
                    exhausted = True
                    break
                admitted = self._admit(request)
                if isinstance(admitted, Result):
                    yield admitted
                else:
                    self.scheduler.add(admitted)
            if not self.scheduler.has_unfinished():
                if exhausted:
                    return
                continue
            yield from self.step()

    def step(self) -> list[Result]:
        out = self.scheduler.schedule()
        if not out:
            raise RuntimeError("scheduler could not schedule any work")  # the admission checks rule this out
        sampled_seqs, tokens = self.runner.execute(out.num_scheduled_tokens)
        self.num_steps += 1
        now = time.monotonic()
        for seq, n in out.num_scheduled_tokens.items():
            seq.num_computed_tokens += n
        finished = []
        for seq, token in zip(sampled_seqs, tokens):
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason:
                seq.finish_reason, seq.finish_time = reason, now
                self.scheduler.finish(seq)
                finished.append(seq)
        return [self._result(seq) for seq in finished]

    def stats(self) -> dict:
        s = self.scheduler
        return {
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            "num_preemptions": s.num_preemptions,
            "num_steps": self.num_steps,
            "kv_cache_tokens": self.kv_capacity,
            "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    # -- admission, stopping, results --------------------------------------------------------------------------------

    def _admit(self, request: Request) -> Sequence | Result:
        params, ids = request.sampling_params, request.prompt_token_ids
        try:
            params.validate()
        except ValueError as e:
            return self._error(request, f"invalid sampling parameters: {e}")
        if ids is None or len(ids) == 0:
            return self._error(request, "empty prompt: it has no tokens")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            return self._error(request, f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            limit = ("the KV cache holds" if self.max_model_len == self.kv_capacity < self.model.max_model_len
                     else "the model's context window is")
            return self._error(request, f"prompt has {len(ids)} tokens but {limit} {self.max_model_len} tokens "
                                        f"(at least one must be left to generate)")
        if params.stop and self.tokenizer is None:
            return self._error(request, "stop strings need a tokenizer and this model has none")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence.from_request(request, seed)
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids, params.skip_special_tokens,
                                                     params.stop, min_tokens=params.min_tokens)
        return seq

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        num_out = seq.num_output_tokens
        stop_string = seq.detokenizer.append([token]) if seq.detokenizer is not None else None
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids or (token in self._eos and not params.ignore_eos):
                return "stop"
            if stop_string is not None:
                return "stop"
        if num_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _result(self, seq: Sequence) -> Result:
        if seq.detokenizer is not None:
            text = seq.detokenizer.text
        elif self.tokenizer is not None:
            text = detokenize(self.tokenizer, seq.output_token_ids, seq.params.skip_special_tokens)
        else:
            text = ""
        wall = self.clock.wall
        return Result(seq.request_id, text, seq.output_token_ids, seq.finish_reason, None, seq.num_prompt_tokens,
                      seq.num_output_tokens, max(seq.num_cached_tokens, 0), seq.num_preemptions,
                      wall(seq.arrival_time), wall(seq.first_scheduled_time), wall(seq.first_token_time),
                      wall(seq.finish_time))

    def _error(self, request: Request, message: str) -> Result:
        now = self.clock.wall(time.monotonic())
        ids = request.prompt_token_ids
        return Result(request.request_id, "", [], "error", message, len(ids) if ids is not None else 0, 0, 0,
                      0, now, None, None, now)
