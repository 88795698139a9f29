"""Grammar-constrained decoding through xgrammar (vLLM's and SGLang's default; the measurement that chose it is in
docs/structured-output.md): a constraint (regex, JSON schema or EBNF grammar) is compiled once per distinct text
against the model's vocabulary, each constrained sequence owns a matcher that follows its tokens, and a step fills
the token bitmask of its constrained rows only.

xgrammar is an optional extra (`pip install 'batchgen[structured]'`): an unconstrained job never imports it."""
from __future__ import annotations

import functools
import json
from typing import Any

from .errors import SettingError

INSTALL_HINT = "pip install 'xgrammar==0.2.9'"


def _xgrammar(key: str):
    try:
        import xgrammar
    except ImportError:
        raise SettingError(key, f"{key} needs the xgrammar library, which is not installed: {INSTALL_HINT} "
                                f"(or pip install 'batchgen[structured]')") from None
    return xgrammar


def check_constraint(key: str, text: str) -> None:
    """Raise SettingError naming `key` when `text` is not a well-formed constraint of its kind."""
    _parse(key, text)


@functools.lru_cache(maxsize=256)
def _parse(key: str, text: str) -> Any:
    """The constraint's xgrammar Grammar (no vocabulary needed); cached by its text, so a million rows with one
    schema parse it once."""
    xgr = _xgrammar(key)
    if key == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise SettingError(key, f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise SettingError(key, f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
    build = {"regex": xgr.Grammar.from_regex, "json_schema": xgr.Grammar.from_json_schema,
             "grammar": xgr.Grammar.from_ebnf}[key]
    try:
        return build(text)
    except Exception as exc:  # xgrammar raises RuntimeError with its C++ source location first
        raise SettingError(key, f"{key} does not compile: {_message(exc)}") from None


def _message(exc: Exception) -> str:
    """xgrammar's error without its '[time] /project/cpp/file.cc:line: ' prefix."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if line.startswith("[") and ": " in line:
        line = line.split(": ", 1)[1]
        if ".cc:" in line.split(" ")[0]:
            line = line.split(": ", 1)[-1]
    return line


class Matcher:
    """One constrained sequence's place in its grammar: it accepts the tokens the sequence appends and says which
    tokens may come next. EOS is allowed exactly where the grammar accepts the output so far."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class GrammarCompiler:
    """Constraints compiled against one model's vocabulary, once per distinct (key, text). The vocabulary's tables
    are built on the first constrained request: an unconstrained run pays nothing."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler = None
        self._compiled: dict[tuple[str, str], Any] = {}

    def matcher(self, key: str, text: str) -> Matcher:
        """A fresh matcher for the constraint; SettingError naming `key` when it does not compile."""
        compiled = self._compiled.get((key, text))
        if compiled is None:
            compiled = self._compiled[key, text] = self._compile(key, text)
        return Matcher(_xgrammar(key).GrammarMatcher(compiled))

    def _tokenizer_info(self, xgr) -> Any:
        """The vocabulary as xgrammar sees it, special tokens other than EOS blanked: xgrammar finds no special
        tokens in a tokenizer like SmolLM2's and would let `<|im_start|>` into a JSON string as its text; a blank
        token is one it never allows (EOS stays allowed where the grammar accepts)."""
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos_token_ids)
        special = {token for token, added in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
                   if added.special and token not in self.eos_token_ids}
        if not special:
            return info
        vocab = [""] * self.vocab_size
        for text, token in self.tokenizer.get_vocab().items():
            if token < self.vocab_size and token not in special:
                vocab[token] = text
        return xgr.TokenizerInfo(vocab, info.vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=self.eos_token_ids, add_prefix_space=info.add_prefix_space)

    def _compile(self, key: str, text: str) -> Any:
        xgr = _xgrammar(key)
        _parse(key, text)  # the same checks, and messages, as validation
        if self._compiler is None:
            if self.tokenizer is None:
                raise SettingError(key, f"{key} needs a tokenizer and this model has none")
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(xgr), max_threads=1)
        try:
            if key == "json_schema":
                # compact JSON: with free whitespace, a small model can emit blank lines until max_tokens
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            if key == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(text)
        except Exception as exc:
            raise SettingError(key, f"{key} does not compile: {_message(exc)}") from None


class TokenBitmask:
    """The allowed next tokens of a step's constrained rows, as xgrammar's packed bitmask (32 tokens per int32),
    applied to those rows' logits only: on the CPU by batchgen's C++ kernel (xgrammar's takes ~0.16 ms per row when
    the mask forbids nearly everything, docs/structured-output.md), elsewhere by xgrammar's."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buffer = None

    def apply(self, logits, matchers: dict[int, Matcher]) -> None:
        """Set logits[row] to -inf wherever matchers[row] forbids the next token. logits: [B, V] fp32, in place;
        rows without a matcher are left alone."""
        import torch

        xgr = _xgrammar("grammar")
        num_rows = logits.shape[0]
        if self._buffer is None or self._buffer.shape[0] < num_rows:
            self._buffer = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        bitmask = self._buffer[:num_rows]
        for row, matcher in matchers.items():
            matcher._matcher.fill_next_token_bitmask(bitmask, row)
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() \
                and logits.shape[-1] <= 32 * bitmask.shape[-1] and _cpu_kernels():
            from batchgen_kernels import cpu_backend
            cpu_backend.apply_token_bitmask_(logits, bitmask, torch.tensor(list(matchers), dtype=torch.long))
            return
        if logits.device != bitmask.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=list(matchers))


@functools.lru_cache(maxsize=1)
def _cpu_kernels() -> bool:
    from batchgen_kernels import cpu_build
    return cpu_build.load()
