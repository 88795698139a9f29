"""The rows a benchmark runs: built-in synthetic workloads (deterministic from a seed) or a job file's input.

Every workload ends as a list of BenchRow: token ids (chat template already applied, as `batchgen run` builds them)
and a max_tokens. Decoding is always greedy, with natural EOS stopping unless the bench runs fixed-length
(`--ignore-eos`), so only these two things vary per row. `--max-tokens N` gives every row the same max_tokens
(`fixed_max_tokens`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("labeling", "generation", "mixed")  # and realistic: workload_realistic.py


@dataclass
class BenchRow:
    id: int
    token_ids: list[int]  # the full prompt, chat template included
    max_tokens: int
    kind: str  # labeling | generation | realistic | job | random


@dataclass
class Workload:
    name: str  # labeling | generation | mixed | realistic | job:<file>
    model: str  # what EngineArgs.model takes: "default", a directory or a .gguf
    rows: list[BenchRow]
    notes: list[str] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.rows)

    @property
    def max_output_tokens(self) -> int:
        return sum(row.max_tokens for row in self.rows)

    def describe(self) -> dict[str, Any]:
        lengths = sorted(len(row.token_ids) for row in self.rows) or [0]
        return {"name": self.name, "model": self.model, "rows": len(self.rows), "prompt_tokens": self.prompt_tokens,
                "prompt_tokens_min": lengths[0], "prompt_tokens_max": lengths[-1],
                "max_output_tokens": self.max_output_tokens, "notes": self.notes}


# -- word lists and templates ------------------------------------------------------------------------------------

PRODUCTS = ["wireless earbuds", "standing desk", "espresso machine", "trail running shoes", "robot vacuum",
            "mechanical keyboard", "air fryer", "e-reader", "camping tent", "electric toothbrush", "office chair",
            "baby monitor", "smart thermostat", "blender", "rain jacket", "phone case", "garden hose", "backpack"]
SERVICES = ["billing", "login", "the mobile app", "order tracking", "the invoice export", "password reset",
            "the delivery slot picker", "two-factor authentication", "the loyalty points page", "refunds"]
OPENINGS = {
    "positive": ["Honestly impressed.", "Exceeded my expectations.", "Best purchase this year.",
                 "Really happy with it.", "I was sceptical at first, but I love it."],
    "negative": ["Very disappointed.", "Would not buy again.", "Returned it after a week.", "Not worth the money.",
                 "This has been a frustrating experience."],
    "neutral": ["It is fine.", "Does what it says.", "Mixed feelings overall.", "About what I expected.",
                "Nothing special, nothing terrible."],
}
DETAILS = {
    "positive": ["Setup took five minutes and it has worked flawlessly since.", "The build quality feels premium.",
                 "Battery life is even better than advertised.", "Customer support answered within an hour.",
                 "My whole family uses it every day now.", "It is quiet, fast and easy to clean.",
                 "The price was fair for what you get.", "I already ordered a second one as a gift."],
    "negative": ["It stopped working after two weeks.", "The instructions were missing half the steps.",
                 "It is much louder than the description suggests.", "Support never replied to my emails.",
                 "The box arrived damaged and a part was missing.", "The battery barely lasts an afternoon.",
                 "It overheats after ten minutes of use.", "The refund took over a month."],
    "neutral": ["Shipping was on time.", "The color is slightly different from the photos.",
                "It works, but the app is clunky.", "Price is average for this category.",
                "Some features are useful, others I never touch.", "It is heavier than I thought it would be.",
                "The manual is long but clear enough.", "It replaced an older model that did the same job."],
}
TICKET_PROBLEMS = ["I cannot open {service} since this morning.", "{service} shows an error every time I try.",
                   "I was charged twice and {service} does not show it.", "{service} keeps logging me out.",
                   "Nothing happens when I press the button in {service}.", "{service} is very slow today."]
TICKET_DETAILS = ["I already restarted my phone and cleared the cache.", "My account number is in my profile.",
                  "This is the third time this month.", "A colleague has the same problem on her laptop.",
                  "I need this fixed before Friday for an audit.", "The error message says to contact support.",
                  "I tried both the website and the app.", "Please let me know if you need screenshots."]

TOPICS = ["the history of the printing press", "how vaccines train the immune system", "the economics of coffee",
          "why cities build ring roads", "the life cycle of a star", "how bees communicate", "the rules of chess",
          "the invention of the telephone", "how a bill becomes law", "the water cycle", "the silk road",
          "how compilers work", "the migration of whales", "the origins of jazz", "how glaciers shape valleys",
          "the first moon landing", "the basics of compound interest", "how bread rises"]
TASKS = ["Write a short essay about {topic}.", "Explain {topic} to a curious twelve-year-old.",
         "Give me a structured overview of {topic}, with a few key facts.",
         "Summarize the notes below and then add what is missing about {topic}.",
         "Write a blog post introduction about {topic}.", "List the most common misconceptions about {topic}."]
SUBJECTS = ["The committee", "A small team of researchers", "The local library", "Our neighbour", "The old factory",
            "A group of students", "The city council", "The museum", "A travelling musician", "The bakery downstairs",
            "The school board", "An engineer from the north"]
VERBS = ["announced", "discovered", "argued about", "rebuilt", "measured", "questioned", "celebrated", "documented",
         "postponed", "explained", "compared", "redesigned"]
OBJECTS = ["a new plan for the harbour", "the results of the spring survey", "the history of the river crossing",
           "a cheaper way to heat the hall", "the rules for the summer market", "the oldest map in the archive",
           "a proposal for more bicycle lanes", "the cost of repairing the bridge", "the schedule for the festival",
           "a collection of letters from the war", "the noise from the new railway", "the future of the orchard"]
CLAUSES = ["after a long meeting on Tuesday", "although few people expected it", "because the budget was tight",
           "while the weather stayed cold", "to the surprise of the press", "with help from volunteers",
           "before the end of the season", "despite several complaints", "for the first time in decades",
           "as the town had hoped"]

# The labeling workload's shared instruction: one system prompt, identical for every row (about 250 tokens with
# the chat template around it), which is what the prefix cache is for.
LABELING_INSTRUCTION = """You are a careful annotator working for the customer experience team of a large online \
retailer. Each message you receive is either a product review written by a customer or a support ticket sent to \
the help desk. Read it once, completely, and classify it with exactly one label from this list:
- positive: the customer is satisfied overall and would recommend the product or the service, even if they \
mention a small flaw along the way.
- negative: the customer is dissatisfied overall: the product failed, was returned, arrived damaged, or was not \
worth the money, or the service did not work.
- neutral: the message is factual or mixed and does not lean clearly either way.
- urgent: a support ticket that blocks the customer from paying, logging in or receiving an order, or that \
mentions a deadline.
Rules: judge the overall opinion, not individual sentences. Shipping and support count only when the message is \
mostly about them. Ignore the price range: a cheap product and an expensive one are judged the same way. If two \
labels fit, prefer urgent, then negative. Never explain your answer, never add punctuation, never repeat the \
message, and never answer with more than one word."""
LABELING_LABELS = ["positive", "negative", "neutral", "urgent"]  # the instruction's labels, in its order


# -- building prompts --------------------------------------------------------------------------------------------

class PromptTokenizer:
    """Chat-template a conversation and tokenize it the way batchgen.job.input.source does (template to text, then
    tokens without extra special tokens). A model without a chat template (a base model) gets the text as a job with
    `chat_template: false` sends it: the system text, a blank line, the user's, with the tokenizer's own special
    tokens (a BOS, which such models need)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.chat = getattr(tokenizer, "chat_template", None) is not None

    def __call__(self, user: str, system: str | None = None) -> list[int]:
        if not self.chat:
            text = user if system is None else f"{system}\n\n{user}"
            return list(self.tokenizer([text], add_special_tokens=True)["input_ids"][0])
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
                   [{"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer([text], add_special_tokens=False)["input_ids"][0])


def sentence(rng: random.Random) -> str:
    text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(CLAUSES)}."
    return text


def grow_to(rng: random.Random, target_tokens: int, build: Any, add: Any) -> list[int]:
    """Add sentences (`add`) to a text until the prompt that `build` makes of it has at least target_tokens."""
    parts: list[str] = []
    ids = build(parts)
    while len(ids) < target_tokens:
        parts.append(add(rng))
        ids = build(parts)
    return ids


def generation_row(rng: random.Random, tokenize: PromptTokenizer, row_id: int, scale: float) -> BenchRow:
    """A writing task over a block of notes: prompt of 50-400 tokens, max_tokens 32-256."""
    target = rng.randint(50, 400)
    max_tokens = rng.randint(32, 256)
    task = rng.choice(TASKS).format(topic=rng.choice(TOPICS))
    build = lambda parts: tokenize(task + ("\n\nNotes:\n" + " ".join(parts) if parts else ""))
    ids = grow_to(rng, target, build, sentence)
    return BenchRow(row_id, ids, scaled(max_tokens, scale), "generation")


def review_or_ticket(rng: random.Random) -> tuple[str, Any]:
    """The start of a message to classify and how to lengthen it."""
    if rng.random() < 0.6:
        mood = rng.choice(list(OPENINGS))
        head = f"Review of the {rng.choice(PRODUCTS)}: {rng.choice(OPENINGS[mood])}"
        return head, lambda r: r.choice(DETAILS[mood])
    service = rng.choice(SERVICES)
    head = f"Support ticket #{rng.randint(10000, 99999)}: " + rng.choice(TICKET_PROBLEMS).format(service=service)
    return head, lambda r: r.choice(TICKET_DETAILS)


def labeling_row(rng: random.Random, tokenize: PromptTokenizer, row_id: int, scale: float,
                 shared_tokens: int) -> BenchRow:
    """The shared instruction (system prompt) + a review or ticket of about 100 tokens of its own; max_tokens 8."""
    own = rng.randint(85, 115)
    head, more = review_or_ticket(rng)
    build = lambda parts: tokenize(" ".join([head] + parts) + "\nLabel:", system=LABELING_INSTRUCTION)
    ids = grow_to(rng, shared_tokens + own, build, more)
    return BenchRow(row_id, ids, scaled(8, scale), "labeling")


def scaled(max_tokens: int, scale: float) -> int:
    return max(1, round(max_tokens * scale))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_prefix_length(rows: list[BenchRow]) -> int:
    """Tokens at the start of every row's prompt that all rows share."""
    if not rows:
        return 0
    return min((common_prefix(rows[0].token_ids, row.token_ids) for row in rows[1:]), default=len(rows[0].token_ids))


def synthetic_workload(name: str, num_rows: int, seed: int, tokenizer: Any, model: str = "default",
                       max_tokens_scale: float = 1.0) -> Workload:
    """`generation`, `labeling` or `mixed` (half of each, shuffled), deterministic from `seed`."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    rng = random.Random(seed)
    tokenize = PromptTokenizer(tokenizer)
    num_labeling = {"labeling": num_rows, "generation": 0, "mixed": num_rows // 2}[name]
    # The head every labeling row starts with: the system prompt inside the chat template, up to the user's text.
    shared = common_prefix(tokenize("A", system=LABELING_INSTRUCTION), tokenize("B", system=LABELING_INSTRUCTION))
    kinds = ["labeling"] * num_labeling + ["generation"] * (num_rows - num_labeling)
    rng.shuffle(kinds)
    rows = [labeling_row(rng, tokenize, i, max_tokens_scale, shared) if kind == "labeling"
            else generation_row(rng, tokenize, i, max_tokens_scale) for i, kind in enumerate(kinds)]
    workload = Workload(name, model, rows)
    labeled = [row for row in rows if row.kind == "labeling"]
    if labeled:
        workload.notes.append(f"labeling rows share a {shared_prefix_length(labeled)}-token prefix "
                              f"(system prompt{' + chat template' if tokenize.chat else ', no chat template'})")
    if max_tokens_scale != 1.0:
        workload.notes.append(f"max_tokens scaled by {max_tokens_scale}")
    return workload


def fixed_max_tokens(workload: Workload, max_tokens: int) -> Workload:
    """The same prompts, every row with max_tokens `max_tokens` (with ignore_eos: exactly that many tokens a row)."""
    rows = [BenchRow(row.id, row.token_ids, max_tokens, row.kind) for row in workload.rows]
    notes = workload.notes + [f"every row's max_tokens set to {max_tokens}"]
    return Workload(workload.name, workload.model, rows, notes)


def random_token_rows(num_rows: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], vocab_size: int,
                      seed: int) -> list[BenchRow]:
    """The GPU check's offline workload, which needs no tokenizer: prompt and max_tokens lengths uniform in the
    inclusive ranges, token ids uniform over the vocabulary (no shared prefixes), the same for a given seed."""
    rng = random.Random(seed)
    rows = []
    for row_id in range(num_rows):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lens))]
        rows.append(BenchRow(row_id, prompt, rng.randint(*output_lens), "random"))
    return rows


def job_workload(job_path: str | Path, tokenizer: Any, num_rows: int | None = None,
                 max_tokens_scale: float = 1.0) -> Workload:
    """The rows of a job file's input, prompts built by batchgen.job.input.source exactly as `batchgen run` builds them
    (including its sort), each with its max_tokens. Sampling is forced to greedy; stop strings, penalties and
    min_tokens are not applied (the baselines could not honour them all); error rows are left out."""
    from batchgen.job.config import load_job
    from batchgen.job.input.files import inspect_input
    from batchgen.job.input.source import read_source

    config = load_job(job_path)
    inputs = inspect_input(config)
    rows, skipped = [], 0
    for source_row in read_source(config, inputs, tokenizer, max_model_len=None):
        if num_rows is not None and len(rows) >= num_rows:
            break
        if source_row.error is not None:
            skipped += 1
            continue
        if source_row.sampling.max_tokens is None:
            raise ValueError(f"{job_path}: the bench replays rows of a set length; sampling.max_tokens is null "
                             f"(until the context ends) in row {source_row.row}")
        max_tokens = scaled(source_row.sampling.max_tokens, max_tokens_scale)
        rows.append(BenchRow(source_row.row, source_row.token_ids, max_tokens, "job"))
    workload = Workload(f"job:{Path(job_path).name}", config.model, rows,
                        notes=["greedy, EOS stopping and max_tokens only: the job's other sampling keys are not "
                               "applied"])
    if skipped:
        workload.notes.append(f"{skipped} error rows left out")
    return workload
