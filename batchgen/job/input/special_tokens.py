"""Text from the data is tokenized as text: the text of a special token ("<|im_end|>") in a prompt, a system
message or any message content becomes the ordinary tokens of its characters, and only the special tokens that
the chat template writes are special. Otherwise one row of untrusted data could end its own turn and forge a
system turn. `input.allow_special_tokens: true` turns this off.

How: before the chat template is rendered, each special-token text in the data becomes a placeholder. In the
rendered text each placeholder becomes a *stand-in*: a special token of the tokenizer that the text does not
hold. The text is then tokenized as before, in one batched call, and each stand-in id is replaced by the ids of
the text it stands for, tokenized as plain text. A special token is a hard boundary for the tokenizer, so the
text around a stand-in gets exactly the ids it got around the special token it replaces, and a row whose data
holds no special-token text is tokenized exactly as it was without this module.

Not covered: a special token that the chat template assembles from pieces of the data (no supported model's
template does; roles, the one such piece in many templates, are checked against a fixed list), and added tokens
that the tokenizer does not mark special (e.g. Qwen3's <think>), which the tokenizer matches in any text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Private-use characters: no tokenizer's special token contains them.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}([0-9]+){_CLOSE}")


class SpecialTokenError(ValueError):
    """A row whose special-token text cannot be tokenized as plain text."""


@dataclass(frozen=True)
class PromptText:
    """A prompt ready to tokenize: `text`, and for each `stand_in` token in it the plain-text ids it stands for."""

    text: str
    stand_in: int | None = None
    plain: tuple[tuple[int, ...], ...] = ()


class PromptEncoder:
    """Renders and tokenizes prompts so that special-token text from the data stays text."""

    def __init__(self, tokenizer: Any, allow_special_tokens: bool, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # the job's own; None: the tokenizer's
        added = getattr(tokenizer, "added_tokens_decoder", {})  # none: no special tokens to guard
        special = {t.content: i for i, t in added.items() if t.special}
        self.special_ids = frozenset(special.values())
        self.guard = not allow_special_tokens and bool(special)
        if self.guard:
            self.found = _alternation(special)  # what makes a row's data need the guard
            self.marked = _alternation([*special, _OPEN, _CLOSE])  # and what is then marked (no forged placeholder)
            self.stand_ins = _stand_ins(tokenizer, special)
            self.newline = self._encode_plain("\n")
            self.plain_ids: dict[str, tuple[int, ...]] = {}

    def chat(self, messages: list[dict[str, str]]) -> PromptText:
        """The conversation through the chat template, with the assistant turn opened."""
        if not (self.guard and any(self.found.search(m["content"]) for m in messages)):
            return PromptText(self._render(messages))
        found: list[str] = []
        marked = [{**message, "content": self._mark(message["content"], found)} for message in messages]
        return self._with_stand_ins(self._render(marked), found)

    def raw(self, text: str) -> PromptText:
        """Text that goes to the model as it is (no chat template)."""
        if not (self.guard and self.found.search(text)):
            return PromptText(text)
        found: list[str] = []
        return self._with_stand_ins(self._mark(text, found), found)

    def encode(self, prompts: list[PromptText], add_special_tokens: bool) -> list[list[int]]:
        batch = self.tokenizer([p.text for p in prompts], add_special_tokens=add_special_tokens)["input_ids"]
        return [_restore(prompt, list(ids)) for prompt, ids in zip(prompts, batch)]

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)

    def _mark(self, text: str, found: list[str]) -> str:
        def placeholder(match: re.Match) -> str:
            found.append(match.group())
            return f"{_OPEN}{len(found) - 1}{_CLOSE}"

        return self.marked.sub(placeholder, text)

    def _with_stand_ins(self, text: str, found: list[str]) -> PromptText:
        token = next(((t, i) for t, i in self.stand_ins if t not in text), None)
        if token is None:
            raise SpecialTokenError("the chat template writes every special token that could stand in for the "
                                    "special-token text in this row's data")
        plain: list[tuple[int, ...]] = []

        def stand_in(match: re.Match) -> str:
            plain.append(self._plain(found[int(match.group(1))]))
            return token[0]

        text = _PLACEHOLDER.sub(stand_in, text)
        if _OPEN in text or _CLOSE in text:  # the template cut a placeholder apart
            raise SpecialTokenError("the chat template changed special-token text from the data")
        return PromptText(text, token[1], tuple(plain))

    def _plain(self, text: str) -> tuple[int, ...]:
        """`text` tokenized as plain text in the middle of a prompt (cached: only special-token texts come here)."""
        if text not in self.plain_ids:
            # After a newline, then without it: a SentencePiece tokenizer marks the start of a text ("▁"), which
            # this text is not.
            ids = self._encode_plain("\n" + text)
            ids = ids[len(self.newline):] if ids[:len(self.newline)] == self.newline else self._encode_plain(text)
            if self.special_ids.intersection(ids):
                raise SpecialTokenError(f"{text!r} cannot be tokenized as plain text by this model's tokenizer")
            self.plain_ids[text] = tuple(ids)
        return self.plain_ids[text]

    def _encode_plain(self, text: str) -> list[int]:
        return list(self.tokenizer([text], add_special_tokens=False, split_special_tokens=True)["input_ids"][0])


def _alternation(texts: Any) -> re.Pattern:
    """Matches any of `texts`, the longest first where several start at one place (as the tokenizer does)."""
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def _stand_ins(tokenizer: Any, special: dict[str, int]) -> list[tuple[str, int]]:
    """Special tokens that can stand in for data's text: matched alone and exactly, with no whitespace
    stripping, and never added by the tokenizer itself (e.g. a BOS)."""
    added = set(tokenizer(["a"], add_special_tokens=True)["input_ids"][0])
    decoder = tokenizer.added_tokens_decoder
    usable = [(t, i) for t, i in special.items() if i not in added and not
              (decoder[i].lstrip or decoder[i].rstrip or decoder[i].single_word or decoder[i].normalized)]
    encoded = tokenizer([f"a{t}a" for t, _ in usable], add_special_tokens=False)["input_ids"]
    return [(t, i) for (t, i), ids in zip(usable, encoded) if list(ids).count(i) == 1]


def _restore(prompt: PromptText, ids: list[int]) -> list[int]:
    """Replace each stand-in id by the plain-text ids it stands for."""
    if prompt.stand_in is None:
        return ids
    if ids.count(prompt.stand_in) != len(prompt.plain):
        raise RuntimeError("stand-in tokens were lost in tokenization")
    plain = iter(prompt.plain)
    return [i for token in ids for i in (next(plain) if token == prompt.stand_in else (token,))]
