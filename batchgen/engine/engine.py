"""The offline engine's request lifecycle: add requests, step (schedule, run the model, update), return results as
they finish. `generate()` is a loop over that public API, as the job runner, the bench and a Ray replica use it."""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batchgen.machine import process_rss

from .engine_args import EngineArgs
from .kv_cache_manager import KVCacheManager
from .output_processor import OutputProcessor
from .errors import SettingError
from .process_memory import peak_rss_bytes
from .pooler import ModelPooling, PrefillPrompt, check_prefill, classifier_of, model_pooling
from .request_stream import stream_results
from .request import PoolingParams, Request, Result
from .request_group import PrefillGroup, RequestGroup
from .sampler import PenaltyState, has_penalty
from .scheduler import Scheduler, StepStats
from .sequence import BASE_MODEL, AdapterIdentity, SequenceStatus
from .startup import set_up
from .step_times import StepTimes
from .structured import GrammarCompiler


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        setup = set_up(args)
        self.plan = setup.plan  # every start-up decision and why (engine_plan.py); the fields below are its
        self.device = setup.device
        self.dtype, self.dtype_reason = setup.dtype.dtype, setup.dtype.reason  # the reason: why auto chose it
        self.attention = setup.attention  # the attention kernels that run, and why (a fallback says what failed)
        self.tokenizer, self.model = setup.tokenizer, setup.model
        self.vocab_size = self.model.vocab_size
        self.num_parameters, self.weights_bytes = setup.num_parameters, setup.weights_bytes
        self.kv_pool = setup.kv_pool
        self.kv_capacity = setup.kv_pool.tokens
        self.max_model_len = setup.max_model_len
        self.context_limit = setup.context_limit  # which limit max_model_len is, e.g. "the KV cache holds N tokens"
        self.kv_cache_manager = KVCacheManager(self.kv_pool.num_blocks, args.block_size, args.enable_prefix_caching,
                                               self.kv_pool.local)
        self.adapters = setup.adapters  # lora.attach.AdapterSlots with EngineArgs.lora: names, salts, slots
        self.speculator = setup.speculator  # speculative.Speculator with EngineArgs.speculative, else None
        self.scheduler = Scheduler(self.kv_cache_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   max_adapters=self.adapters.num_slots if self.adapters is not None else None,
                                   speculator=self.speculator)
        self.runner = setup.runner
        self.eos_token_ids = setup.eos_token_ids  # every token that ends generation, the model's own first
        self.task = args.task  # generate, or a prefill-only task (pooler.py): what every request returns
        self.classifier = classifier_of(self.model) if self.task == "classify" else None
        self.pooling = model_pooling(setup.model_dir) if self.task == "embed" else ModelPooling()
        if self.classifier is not None:
            self.runner.classifier_head = self.model.score
        self.output = OutputProcessor(self.tokenizer, setup.eos_token_ids, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, setup.eos_token_ids)
        self._seeds = random.Random(args.seed)
        self._unfinished: dict[Any, RequestGroup] = {}  # by request id
        self._rejected: list[Result] = []  # error results of requests not admitted, returned by the next step()
        self._last_choice: tuple[list[str], list[list[int]]] | None = None  # a `choice` and its candidates' ids
        self.num_steps = 0
        self.num_results = 0  # results returned (a request of n samples: n), error results included
        self.num_sampled_tokens = 0  # output tokens, counted as they are sampled
        self.step_times = StepTimes()
        self.last_step: StepStats | None = None

    # -- the public request API --------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. One that cannot run (invalid sampling parameters, an empty, out-of-vocabulary or too
        long prompt, a constraint that does not compile) is not raised: its error Result comes out of the next
        step(). A request with n samples yields n Results, together, from one step()."""
        if request.request_id in self._unfinished:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        adapter = self._adapter(request.lora)
        if adapter is None:
            known = ", ".join(sorted(self.adapters.sources)) if self.adapters else "none"
            self._rejected.append(self.output.error(request, f"lora adapter {request.lora!r} is not loaded "
                                                             f"(loaded: {known})"))
            return
        if self.task != "generate":
            self._add_prefill(request)
            return
        problem = self._check(request)
        candidates, new_matcher = None, lambda: None
        if problem is None:
            try:
                candidates = self._candidates(request)
                new_matcher = self._matcher_factory(request)
            except SettingError as exc:
                problem = str(exc)
        if problem is not None:
            self._rejected.append(self.output.error(request, problem))
            return
        params = request.sampling_params
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        group = RequestGroup(request, seed, candidates, new_matcher, adapter)
        for seq in group.members:
            if seq.samples:
                if has_penalty(params):
                    seq.penalty_state = PenaltyState(seq.token_ids, self.vocab_size, self.device)
                self.output.track(seq)
        self._unfinished[request.request_id] = group
        for seq in group.first_sequences:
            self.scheduler.add(seq)

    def _adapter(self, name: str | None) -> AdapterIdentity | None:
        """The name and prefix-cache salt of LoRA adapter `name` (None: the base model); None if not known."""
        if name is None:
            return BASE_MODEL
        return self.adapters.identity(name) if self.adapters is not None else None

    def _add_prefill(self, request: Request) -> None:
        """A prefill-only request (task embed, classify or score): its PoolingParams apply, its sampling is ignored."""
        params = request.pooling_params if request.pooling_params is not None else PoolingParams()
        prompt = PrefillPrompt(request.prompt_token_ids, 0, self._check_prompt(request.prompt_token_ids))
        if prompt.problem is None:
            prompt = check_prefill(self.task, params, prompt.token_ids, self.max_model_len, self.context_limit,
                                   self.plan.model.hidden_size)
        if prompt.problem is not None:
            self._rejected.append(self.output.error(request, prompt.problem))
            return
        group = PrefillGroup(request, prompt, self.task, params, self.classifier, self.pooling)
        self._unfinished[request.request_id] = group
        self.scheduler.add(group.members[0])

    def step(self) -> list[Result]:
        """One engine step. Returns the results that finished in it, after the error results of requests added
        since the last step; [] when there is nothing to do."""
        results, self._rejected = self._rejected, []
        self.num_results += len(results)
        if not self.scheduler.has_unfinished():
            return results
        started = time.perf_counter()
        out = self.scheduler.schedule()
        if not out:
            raise RuntimeError("scheduler could not schedule any work")  # the admission checks rule this out
        if out.lookaheads:
            out.set_drafts(self.speculator.propose(out.lookaheads))
        self.last_step = out.stats()
        self.runner.zero_blocks_below(*self.kv_cache_manager.num_touched())
        self.runner.copy_blocks(*self.kv_cache_manager.take_pending_copies())
        step = self.runner.execute(out.num_scheduled_tokens)
        self.num_steps += 1
        self.num_sampled_tokens += len(step.sampled)
        for seq in self.scheduler.update_from_output(out, step, self.output.stop_reason):
            group = self._unfinished[seq.request_id]
            if group.on_finished(seq):
                del self._unfinished[seq.request_id]
                finished = group.results(self.output)
                self.num_results += len(finished)
                results.extend(finished)
        self.step_times.observe(time.perf_counter() - started, self.last_step.num_seqs,
                                self.last_step.num_decodes + self.last_step.num_prefill_tokens)
        return results

    def abort(self, request_id: Any) -> bool:
        """Drop an unfinished request, giving back its KV blocks; it yields no Result. False if it is unknown."""
        group = self._unfinished.pop(request_id, None)
        if group is None:
            return False
        for seq in group.sequences:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.abort(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._unfinished or self._rejected)

    def generate(self, requests: Iterable[Request], on_step: Callable[[], None] | None = None) -> Iterator[Result]:
        """Yield a Result for every request, in completion order. `requests` may be a lazy iterable of any length:
        a new one is pulled only while fewer than max_num_seqs requests wait to run. on_step(): called after each
        step (the job runner samples the engine's stats there for its timeline)."""
        return stream_results(self, requests, lambda: len(self.scheduler.waiting) + len(self._rejected),
                              self.args.max_num_seqs, on_step)

    def stats(self) -> dict:
        """Counters of the run so far, the dtype and the attention kernels and why, and the KV pool: its size and
        why, the blocks in use now and at most at once, and the blocks ever used (on the CPU, the part of the pool
        that is resident). With a local group (sliding-window layers) the block counts are the global pool's, the
        `kv_local_` ones the local pool's (less its null block, but for blocks touched), and the bytes both pools'."""
        s, pool, kv = self.scheduler, self.kv_cache_manager.pool, self.kv_pool
        local = self._local_kv_stats()
        return {
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            "num_preemptions": s.num_preemptions,
            "num_steps": self.num_steps,
            **self.step_times.stats(),
            "num_results": self.num_results,
            "num_sampled_tokens": self.num_sampled_tokens,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "kv_cache_tokens": self.kv_capacity,
            "task": self.task,
            "dtype": str(self.dtype).removeprefix("torch."),
            "dtype_reason": self.dtype_reason,
            "model_path": self.plan.model.path,  # native (batchgen's implementation) or generic (transformers' code)
            "architecture": self.plan.model.architecture,
            "attention_backend": self.attention.name,
            "attention_backend_reason": self.attention.reason,
            "weights_bytes": self.weights_bytes,
            "kv_pool_blocks": kv.num_blocks,
            "kv_pool_bytes": kv.bytes,
            "kv_pool_reason": kv.reason,
            "kv_block_bytes": kv.block_bytes,
            "kv_cache_dtype": str(self.plan.cache_dtype).removeprefix("torch."),  # engine.kv_cache_dtype
            "kv_bytes_per_token": self.plan.kv_bytes_per_token,
            "kv_blocks_in_use": pool.num_in_use,
            "kv_peak_blocks_used": pool.peak_in_use,
            # the pools' peaks added: what they held at once is at most this
            "kv_peak_bytes_used": pool.peak_in_use * kv.block_bytes + local["peak_bytes"],
            "kv_blocks_touched": pool.num_touched,
            "kv_bytes_touched": pool.num_touched * kv.block_bytes + local["touched_bytes"],
            "kv_local_window": local["window"],
            "kv_local_pool_blocks": local["blocks"],
            "kv_local_block_bytes": local["block_bytes"],
            "kv_local_blocks_in_use": local["in_use"],
            "kv_local_peak_blocks_used": local["peak"],
            "kv_local_blocks_touched": local["touched"],
            "peak_memory_bytes": peak_rss_bytes(),
            "rss_bytes": process_rss(),
            **self._lora_stats(),
            **self._speculative_stats(),
        }

    def _speculative_stats(self) -> dict:
        """Speculative decoding: the guesses verified and the share of them that stood."""
        s = self.scheduler
        return {"speculative": self.speculator.config.method if self.speculator else None,
                "spec_draft_model_bytes": self.speculator.draft_bytes if self.speculator else 0,
                "spec_draft_tokens": s.num_draft_tokens, "spec_accepted_tokens": s.num_accepted_tokens,
                "spec_acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else None}

    def _lora_stats(self) -> dict:
        """The adapters (lora/attach.py): how many, the slots that hold them (their bytes are in weights_bytes),
        and how often one was read into a slot (the first ones included)."""
        a = self.adapters
        return {"lora_adapters": len(a.sources) if a else 0, "lora_slots": a.num_slots if a else 0,
                "lora_loads": a.num_loads if a else 0, "lora_bytes": a.nbytes if a else 0}

    def _local_kv_stats(self) -> dict:
        size, local = self.kv_pool.local, self.kv_cache_manager.local
        if local is None:
            return dict(window=None, blocks=0, block_bytes=0, in_use=0, peak=0, touched=0, peak_bytes=0,
                        touched_bytes=0)
        pool = local.pool
        return dict(window=size.window, blocks=size.num_blocks, block_bytes=size.block_bytes, in_use=pool.num_in_use,
                    peak=pool.peak_in_use, touched=pool.num_touched, peak_bytes=pool.peak_in_use * size.block_bytes,
                    touched_bytes=pool.num_touched * size.block_bytes)

    # -- admission checks ----------------------------------------------------------------------------------------------

    def _check(self, request: Request) -> str | None:
        """Why `request` cannot run, or None."""
        params, ids = request.sampling_params, request.prompt_token_ids
        try:
            params.validate()
        except ValueError as e:
            return f"invalid sampling parameters: {e}"
        problem = self._check_prompt(ids)
        if problem is not None:
            return problem
        if len(ids) >= self.max_model_len:
            return (f"prompt is too long: {len(ids)} tokens, and {self.context_limit} "
                    f"(at least one must be left to generate)")
        if params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer and this model has none"
        if params.choice and self.tokenizer is None:
            return "choice needs a tokenizer and this model has none"
        return None

    def _check_prompt(self, ids: list[int] | None) -> str | None:
        if ids is None or len(ids) == 0:
            return "empty prompt: it has no tokens"
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            return f"prompt token ids must be integers in [0, {self.vocab_size})"
        return None

    def _candidates(self, request: Request) -> list[list[int]] | None:
        """The token ids of each `choice` string, as the model would write it as its answer."""
        choice = request.sampling_params.choice
        if not choice:
            return None
        if self._last_choice is None or self._last_choice[0] != choice:  # a job's rows mostly share theirs
            self._last_choice = (list(choice),
                                 [self.tokenizer.encode(text, add_special_tokens=False) for text in choice])
        candidates = self._last_choice[1]
        longest = len(request.prompt_token_ids) + max(map(len, candidates))
        if longest > self.max_model_len:
            raise SettingError("choice", f"prompt and longest choice make {longest} tokens, more than the "
                                         f"{self.max_model_len} the engine holds")
        return candidates

    def _matcher_factory(self, request: Request):
        """A function making a fresh grammar matcher for each sample of a constrained request (None without)."""
        constraint = request.sampling_params.constraint
        if constraint is None:
            return lambda: None
        self.grammars.matcher(*constraint)  # compiles now: a constraint that fails is this request's error
        return lambda: self.grammars.matcher(*constraint)
