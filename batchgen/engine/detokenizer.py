"""Token ids to text: once at the end (`detokenize`), or token by token with stop-string matching
(`IncrementalDetokenizer`).

Incremental decoding follows the prefix_offset/read_offset scheme of vLLM and TGI: decode a short window of recent
tokens, with and without the new ones, and take the difference. The window starts where text was last emitted
completely, so decoders that depend on context (a leading space dropped at the start of a text, bytes that only make
a character together) see the same context as a full decode, and the text of each step costs O(1) tokens of work.
Text is held back while it ends in U+FFFD, the mark of a character whose bytes have not all arrived; the window
only moves on once a step produced text.

Both paths decode without transformers' legacy `clean_up_tokenization_spaces` (it rewrites " ." as "." across the
whole text, so no window could reproduce it), which keeps their results equal.
"""
from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


def detokenize(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """The output text of one request, token by token, stopping at the first stop string.

    `append` returns the stop string that the text now contains (searching only text that new tokens could have
    completed it with: stop strings may span tokens), or None; `text` is the output so far, cut before the stop
    string once one matched. As in vLLM, a stop string cannot end within the first `min_tokens` tokens (it may begin
    there). The prompt is not decoded: the window starts at the first output token so that `text` equals
    `detokenize(output ids)` exactly.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, stop: list[str], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.stop_string: str | None = None  # the stop string that matched, once one has
        self._prefix_offset = 0  # window start: ids before it are done with
        self._read_offset = 0  # ids before it have had their text emitted
        self._chunks: list[str] = []  # emitted text, not yet joined
        self._emitted_len = 0
        self._held = ""  # text of ids past read_offset (ends in U+FFFD: a character still incomplete)
        self._lookback = max((len(s) for s in self.stop), default=1) - 1
        self._recent = ""  # the last `lookback` characters of the emitted text
        self._searched_len = 0  # stop strings ending within this many characters have been looked for
        self._final_text: str | None = None

    def append(self, new_token_ids: list[int]) -> str | None:
        if self.stop_string is not None:
            return self.stop_string
        self.token_ids.extend(new_token_ids)
        ids = self.token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])[len(prefix_text):]
        previous_len, recent = self._emitted_len, self._recent
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing complete yet (or only skipped special tokens): keep the window where it is, so that the next
            # decode still starts on a token with text (a decoder may strip the first token's leading space).
            self._held, emitted = new_text, ""
        else:
            self._held, emitted = "", new_text
            self._chunks.append(emitted)
            self._emitted_len += len(emitted)
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            self._recent = (recent + emitted)[-self._lookback:] if self._lookback else ""
        # Complete characters so far; a held text's lone U+FFFD tail may still change.
        settled = emitted + self._held.rstrip(REPLACEMENT_CHAR)
        if len(ids) <= self.min_tokens:
            self._searched_len = previous_len + len(settled)
            return None
        return self._search(recent, previous_len - len(recent), settled)

    @property
    def text(self) -> str:
        if self._final_text is not None:
            return self._final_text
        return "".join(self._chunks) + self._held

    def _search(self, recent: str, recent_start: int, settled: str) -> str | None:
        """Find the earliest stop string in `recent + settled` (which starts at character `recent_start` of the
        text) that ends past `_searched_len`."""
        region = recent + settled
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(0, self._searched_len - len(stop) + 1 - recent_start)
            at = region.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        self._searched_len = recent_start + len(region)
        if best is None:
            return None
        self.stop_string = best[1]
        self._final_text = self.text[:recent_start + best[0]]
        return self.stop_string

    def _decode(self, ids: list[int]) -> str:
        return detokenize(self.tokenizer, ids, self.skip_special_tokens)
