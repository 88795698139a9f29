"""transformers static batching, as people write it: rows sorted by prompt length, left-padded batches,
`generate(do_sample=False)` up to the longest max_tokens of the batch. CPU, fp32.

The whole workload runs once per batch size; the fastest run is reported, the others are kept in `details`."""
from __future__ import annotations

import time

from .systems import BenchOptions, RowOutput, SystemRun, elapsed


class StepClock:
    """A logits processor that changes nothing and records when each decoding step produced its logits."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.monotonic())
        return scores


def run(rows: list, options: BenchOptions) -> SystemRun:
    import torch
    from transformers import AutoModelForCausalLM

    from batchgen.model_loader import eos_token_ids, load_tokenizer, resolve_model

    started = time.monotonic()
    model_dir = resolve_model(options.engine_args.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(model_dir)
    load_s = elapsed(started)
    eos = eos_token_ids(model_dir, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else eos[0]

    runs = {}
    for batch_size in options.hf_batch_sizes:
        wall_s, outputs = generate_all(model, rows, batch_size, eos, pad)
        runs[batch_size] = (wall_s, outputs)
    best = min(runs, key=lambda size: runs[size][0])
    wall_s, outputs = runs[best]
    details = {"batch_size": best,
               "runs": {str(size): {"wall_s": w, "output_tokens": sum(len(o.token_ids) for o in outs)}
                        for size, (w, outs) in runs.items()}}
    return SystemRun("hf-static", True, load_s=load_s, wall_s=wall_s, rows=outputs, details=details)


def generate_all(model, rows: list, batch_size: int, eos: list[int], pad: int) -> tuple[float, list[RowOutput]]:
    """Every row, in batches of `batch_size` by prompt length; (wall seconds, outputs)."""
    import torch

    ordered = sorted(rows, key=lambda row: len(row.token_ids))
    outputs = []
    started = time.monotonic()
    with torch.inference_mode():
        for first in range(0, len(ordered), batch_size):
            batch = ordered[first:first + batch_size]
            outputs += generate_batch(model, batch, eos, pad, started)
    return elapsed(started), outputs


def generate_batch(model, batch: list, eos: list[int], pad: int, run_started: float) -> list[RowOutput]:
    import torch
    from transformers import LogitsProcessorList

    width = max(len(row.token_ids) for row in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, row in enumerate(batch):  # left padding: every prompt ends at the last column
        input_ids[i, width - len(row.token_ids):] = torch.tensor(row.token_ids)
        attention_mask[i, width - len(row.token_ids):] = 1
    clock = StepClock()
    generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                               max_new_tokens=max(row.max_tokens for row in batch), eos_token_id=eos,
                               pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
    outputs = []
    for i, row in enumerate(batch):
        kept = cut(generated[i, width:].tolist(), row.max_tokens, eos)
        outputs.append(RowOutput(row.id, kept, clock.times[0] - run_started,
                                 clock.times[len(kept) - 1] - run_started))
    return outputs


def cut(tokens: list[int], max_tokens: int, eos: list[int]) -> list[int]:
    """A row's own output: at most max_tokens, up to and including its first EOS (as batchgen's Result keeps it)."""
    kept = []
    for token in tokens[:max_tokens]:
        kept.append(token)
        if token in eos:
            break
    return kept
