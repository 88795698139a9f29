"""Grammar-constrained decoding through xgrammar (vLLM's and SGLang's default; the measurement that chose it is in
docs/structured-output.md): a constraint (regex, JSON schema or EBNF grammar) is compiled once per distinct text
against the model's vocabulary, each constrained sequence owns a matcher that follows its tokens, and a step fills
the token bitmask of its constrained rows only.

xgrammar is an optional extra (`pip install -e ".[structured]"` in the checkout; scripts/setup.sh installs it): an
unconstrained job never imports it."""
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
                                f"(or pip install -e \".[structured]\" in batchgen's checkout)") from None
    return xgrammar


def check_constraint(key: str, text: str, quote_values: bool = True) -> None:
    """Raise SettingError naming `key` when `text` is not a well-formed constraint of its kind. quote_values=False:
    the message shows no string of the text (a schema file may be a credentials file given by mistake)."""
    try:
        _parse(key, text)
    except SettingError as exc:
        if quote_values or not str(exc).startswith(_COMPILE_ERROR.format(key=key)):
            raise
        raise SettingError(key, _without_values(str(exc), text)) from None  # xgrammar's words, not the file's


_COMPILE_ERROR = "{key} does not compile: "


def _without_values(message: str, text: str) -> str:
    """`message` with every string value of the JSON `text` in it replaced by '…' (its keys stay: they are the
    path to what is wrong)."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return message
    values, stack = set(), [document]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            values.add(node)
        elif isinstance(node, (dict, list)):
            stack.extend(node.values() if isinstance(node, dict) else node)
    for value in sorted(values, key=len, reverse=True):
        if len(value) >= 3:
            message = message.replace(value, "…")
    return message


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
        except RecursionError:
            raise SettingError(key, f"json_schema is nested more than {MAX_SCHEMA_DEPTH} levels deep") from None
        if not isinstance(schema, dict):
            raise SettingError(key, f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
        problem = schema_problem(schema)
        if problem is not None:
            raise SettingError(key, f"json_schema is not a JSON schema: {problem}")
    build = {"regex": xgr.Grammar.from_regex, "json_schema": xgr.Grammar.from_json_schema,
             "grammar": xgr.Grammar.from_ebnf}[key]
    try:
        return build(text)
    except Exception as exc:  # xgrammar raises RuntimeError with its C++ source location first
        raise SettingError(key, _COMPILE_ERROR.format(key=key) + _message(exc)) from None


# JSON schema keywords whose values are schemas, lists of schemas, or mappings of names to schemas.
_SUBSCHEMA = ("additionalProperties", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems", "items")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
MAX_SCHEMA_DEPTH = 64


def schema_problem(schema: Any) -> str | None:
    """The first place where `schema` is not a JSON schema, as its JSON path and what is wrong there, without
    quoting a value; None when its structure is sound. xgrammar checks the rest when it compiles it."""
    stack = [(schema, "$", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"at {path}: nested more than {MAX_SCHEMA_DEPTH} levels deep"
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return f"at {path}: a schema must be an object or true/false, not {_json_kind(node)}"
        kind = node.get("type")
        if kind is not None and not (kind in JSON_TYPES if isinstance(kind, str) else isinstance(kind, list)
                                     and kind and all(isinstance(k, str) and k in JSON_TYPES for k in kind)):
            return f"at {path}.type: not a JSON type name ({', '.join(JSON_TYPES)}) or a list of them"
        required = node.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            return f"at {path}.required: must be a list of property names"
        if "enum" in node and not isinstance(node["enum"], list):
            return f"at {path}.enum: must be a list"
        for word, value in node.items():
            where = f"{path}.{word}"
            if word in _SUBSCHEMA_MAPS:
                if not isinstance(value, dict):
                    return f"at {where}: must be an object of schemas"
                stack.extend((child, _member(where, name), depth + 1) for name, child in value.items())
            elif word in _SUBSCHEMA_LISTS and isinstance(value, list):
                stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(value))
            elif word in _SUBSCHEMA_LISTS and word not in _SUBSCHEMA:
                return f"at {where}: must be a list of schemas"
            elif word in _SUBSCHEMA:
                stack.append((value, where, depth + 1))
            elif _depth(value) > MAX_SCHEMA_DEPTH - depth:
                return f"at {where}: nested more than {MAX_SCHEMA_DEPTH} levels deep"
    return None


def _member(path: str, name: str) -> str:
    return f"{path}.{name}" if name.isidentifier() else f"{path}[{json.dumps(name)}]"


def _depth(value: Any) -> int:
    """How deep lists and objects nest in a JSON value (an enum's or a const's), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth <= MAX_SCHEMA_DEPTH and isinstance(node, (dict, list)):
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _json_kind(value: Any) -> str:
    return {str: "a string", int: "a number", float: "a number", list: "a list", type(None): "null"}.get(
        type(value), type(value).__name__)


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
            raise SettingError(key, _COMPILE_ERROR.format(key=key) + _message(exc)) from None


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
