"""The way out of the engine: stop rules, detokenizing and the Result of each request."""
from __future__ import annotations

import time
from typing import Any

from .detokenizer import IncrementalDetokenizer, detokenize
from .request import Request, Result
from .sequence import Sequence


class Clock:
    """Monotonic time for every measurement, turned into wall-clock timestamps through one fixed anchor."""

    def __init__(self) -> None:
        self._offset = time.time() - time.monotonic()

    def wall(self, monotonic: float | None) -> float | None:
        return None if monotonic is None else monotonic + self._offset


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.clock = Clock()

    def track(self, seq: Sequence) -> None:
        """Prepare for a newly admitted sequence: stop strings are matched on its text as it grows."""
        params = seq.params
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                                     min_tokens=params.min_tokens)

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why `seq` stops after appending `token`: "stop", "length", or None to go on."""
        params = seq.params
        num_out = seq.num_output_tokens
        stop_string = seq.detokenizer.append([token]) if seq.detokenizer is not None else None
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
                return "stop"
            if stop_string is not None:
                return "stop"
        if (params.max_tokens is not None and num_out >= params.max_tokens) or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def result(self, seq: Sequence) -> Result:
        if seq.detokenizer is not None:
            text = seq.detokenizer.text
        elif self.tokenizer is not None:
            text = detokenize(self.tokenizer, seq.output_token_ids, seq.params.skip_special_tokens)
        else:
            text = ""
        wall = self.clock.wall
        return Result(request_id=seq.request_id, text=text, token_ids=seq.output_token_ids,
                      finish_reason=seq.finish_reason, error=None, prompt_tokens=seq.num_prompt_tokens,
                      output_tokens=seq.num_output_tokens, cached_tokens=max(seq.num_cached_tokens, 0),
                      num_preemptions=seq.num_preemptions, arrival_time=wall(seq.arrival_time),
                      first_scheduled_time=wall(seq.first_scheduled_time),
                      first_token_time=wall(seq.first_token_time), finish_time=wall(seq.finish_time),
                      sample_index=seq.sample_index, logprobs=seq.token_logprobs, lora=seq.adapter.name,
                      top_logprobs=None if seq.top_logprobs is None else [self.named_top(t) for t in seq.top_logprobs])

    def named_top(self, top: list[tuple[int, float]]) -> list[tuple[str, int, float]]:
        """(token id, logprob) alternatives with each token's text."""
        return [(self.token_text(token), token, logprob) for token, logprob in top]

    def token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def error(self, request: Request, message: str) -> Result:
        ids = request.prompt_token_ids
        result = Result.for_error(request.request_id, message, len(ids) if ids is not None else 0,
                                  self.clock.wall(time.monotonic()))
        result.lora = request.lora
        return result
