"""transformers static batching, as people write it: rows sorted by prompt length, left-padded batches,
`generate(do_sample=False)` up to the longest max_tokens of the batch. In the bench: CPU, in --hf-dtype.

The whole workload runs once per batch size; the fastest run is reported, the others are kept in `details`.
`generate_all` is also the GPU check's baseline, on the device and in the dtype of the model it is given."""
from __future__ import annotations

import time

from .system_types import BenchOptions, RowOutput, SystemRun, elapsed


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

    from batchgen.models.loader import eos_token_ids, load_tokenizer, reference_model_dir

    started = time.monotonic()
    model_dir = reference_model_dir(options.engine_args.model)  # a GGUF: its fp32 conversion
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, options.hf_dtype)).eval()
    tokenizer = load_tokenizer(model_dir)
    load_s = elapsed(started)
    eos = eos_token_ids(model_dir, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else eos[0]

    runs = {}
    for batch_size in options.hf_batch_sizes:
        wall_s, outputs = generate_all(model, rows, batch_size, eos, pad, ignore_eos=options.ignore_eos)
        runs[batch_size] = (wall_s, outputs)
    best = min(runs, key=lambda size: runs[size][0])
    wall_s, outputs = runs[best]
    details = {"batch_size": best, "dtype": options.hf_dtype,
               "runs": {str(size): {"wall_s": w, "output_tokens": sum(len(o.token_ids) for o in outs)}
                        for size, (w, outs) in runs.items()}}
    return SystemRun("hf-static", True, load_s=load_s, wall_s=wall_s, rows=outputs, details=details)


def generate_all(model, rows: list, batch_size: int, eos: list[int] | None, pad: int,
                 time_limit_s: float | None = None, ignore_eos: bool = False) -> tuple[float, list[RowOutput]]:
    """Rows (with .id, .token_ids, .max_tokens) in batches of `batch_size` by prompt length, on the model's device;
    (wall seconds, outputs). eos None: rows stop where the model's generation config says (the GPU check's models
    say nowhere: ignore_eos). With `ignore_eos`, no row stops before its max_tokens, EOS or not (EOS is not masked:
    vLLM's and batchgen's meaning). With a time limit, no batch starts after it has passed: the outputs are those of
    the batches that ran."""
    import torch

    ordered = sorted(rows, key=lambda row: len(row.token_ids))
    outputs = []
    started = time.monotonic()
    with torch.inference_mode():
        for first in range(0, len(ordered), batch_size):
            batch = ordered[first:first + batch_size]
            outputs += generate_batch(model, batch, eos, pad, started, ignore_eos)
            if time_limit_s is not None and elapsed(started) > time_limit_s:
                break
    return elapsed(started), outputs


def generate_batch(model, batch: list, eos: list[int] | None, pad: int, run_started: float,
                   ignore_eos: bool = False) -> list[RowOutput]:
    import torch
    from transformers import LogitsProcessorList

    width = max(len(row.token_ids) for row in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, row in enumerate(batch):  # left padding: every prompt ends at the last column
        input_ids[i, width - len(row.token_ids):] = torch.tensor(row.token_ids)
        attention_mask[i, width - len(row.token_ids):] = 1
    clock = StepClock()
    stop = {"eos_token_id": None} if ignore_eos else {} if eos is None else {"eos_token_id": eos}
    generated = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                               do_sample=False, max_new_tokens=max(row.max_tokens for row in batch), pad_token_id=pad,
                               logits_processor=LogitsProcessorList([clock]), **stop)
    new_tokens = generated[:, width:].tolist()
    outputs = []
    for row, tokens in zip(batch, new_tokens):
        kept = cut(tokens, row.max_tokens, [] if ignore_eos else eos or [])
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
