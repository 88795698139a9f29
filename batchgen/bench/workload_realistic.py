"""The `realistic` workload (issue 43): rows shaped like a real job's rather than the bench's own mix. It models a
support team's reply-drafting job: one system prompt shared by every row (the assistant's instructions, ~90 tokens
inside the chat template), a customer message of its own of 80-120 tokens (a product review or a support ticket,
varied in wording and length), and a reply of 64 tokens (max_tokens 64). That is the mix issue 43's user ran: 32
rows of ~100-token prompts with a system prompt, 64 output tokens each."""
from __future__ import annotations

import random

from typing import Any

from .workloads import BenchRow, PromptTokenizer, Workload, common_prefix, grow_to, review_or_ticket, scaled
from .workloads import shared_prefix_length

REPLY_INSTRUCTION = """You are a support assistant for a large online retailer. Draft a reply to the customer \
message you receive. Be polite and specific: thank the customer, answer what they actually raised, say what \
happens next (a refund, a replacement, an engineer looking at the fault) and keep it under a hundred words. Do \
not invent order numbers, prices or dates, and never ask for a password."""
REQUESTS = ["Draft a reply to this message.", "Write our answer to the customer below.",
            "Reply to this customer.", "Answer this message on behalf of the support team."]
OUTPUT_TOKENS = 64


def realistic_workload(num_rows: int, seed: int, tokenizer: Any, model: str = "default",
                       max_tokens_scale: float = 1.0) -> Workload:
    """`num_rows` rows, deterministic from `seed`."""
    rows = realistic_rows(num_rows, random.Random(seed), PromptTokenizer(tokenizer), max_tokens_scale)
    return Workload("realistic", model, rows,
                    [f"every row shares a {shared_prefix_length(rows)}-token prefix (system prompt + chat template); "
                     f"a support-reply drafting job"]
                    + ([f"max_tokens scaled by {max_tokens_scale}"] if max_tokens_scale != 1.0 else []))


def realistic_rows(num_rows: int, rng: random.Random, tokenize: PromptTokenizer, scale: float) -> list[BenchRow]:
    # The shared head: the system prompt inside the chat template, up to where the user's text starts.
    shared = common_prefix(tokenize("A", system=REPLY_INSTRUCTION), tokenize("B", system=REPLY_INSTRUCTION))
    rows = []
    for row_id in range(num_rows):
        own = rng.randint(80, 120)
        head, more = review_or_ticket(rng)
        request = rng.choice(REQUESTS)
        build = lambda parts: tokenize(request + "\n\n" + " ".join([head] + parts),  # noqa: E731
                                       system=REPLY_INSTRUCTION)
        rows.append(BenchRow(row_id, grow_to(rng, shared + own, build, more), scaled(OUTPUT_TOKENS, scale),
                             "realistic"))
    return rows
