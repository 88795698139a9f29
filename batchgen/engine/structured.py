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
