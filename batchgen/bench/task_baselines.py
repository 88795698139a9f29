"""The transformers-side baselines of the prefill-only workloads, each as people write it and run once per batch
size (the fastest reported, every run in `details`): embed — sentence-transformers' `SentenceTransformer.encode`;
classify — transformers' `pipeline("text-classification")`; score — a causal LM's forward over right-padded batches,
each token's logprob read from log_softmax. All on the CPU, in --hf-dtype, over the rows' texts (score: their ids)."""
from __future__ import annotations

import time
from typing import Callable

from .system_types import BenchOptions, SystemRun, TaskRowOutput, elapsed


def best_of(name: str, options: BenchOptions, load_s: float,
            run_at: Callable[[int], list[TaskRowOutput]], **details) -> SystemRun:
    """Run the whole workload at each batch size; the fastest run is the system's."""
    runs = {}
    for batch_size in options.hf_batch_sizes:
        started = time.monotonic()
        outputs = run_at(batch_size)
        runs[batch_size] = (elapsed(started), outputs)
    best = min(runs, key=lambda size: runs[size][0])
    wall_s, outputs = runs[best]
    details = {"batch_size": best, "dtype": options.hf_dtype,
               "runs": {str(size): {"wall_s": wall} for size, (wall, _) in runs.items()}, **details}
    return SystemRun(name, True, load_s=load_s, wall_s=wall_s, rows=outputs, details=details)


def sentence_transformers(rows: list, options: BenchOptions) -> SystemRun:
    import torch
    from sentence_transformers import SentenceTransformer

    from batchgen.models.loader import reference_model_dir

    started = time.monotonic()
    model = SentenceTransformer(str(reference_model_dir(options.engine_args.model)), device="cpu",
                                model_kwargs={"dtype": getattr(torch, options.hf_dtype)})
    load_s = elapsed(started)
    texts = [row.text for row in rows]

    def run_at(batch_size: int) -> list[TaskRowOutput]:
        vectors = model.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)
        return [TaskRowOutput(row.id, vector.astype("float64").tolist()) for row, vector in zip(rows, vectors)]

    return best_of("sentence-transformers", options, load_s, run_at, max_seq_length=model.max_seq_length)


def text_classification(rows: list, options: BenchOptions) -> SystemRun:
    import torch
    from transformers import pipeline

    from batchgen.models.loader import reference_model_dir

    started = time.monotonic()
    classifier = pipeline("text-classification", model=str(reference_model_dir(options.engine_args.model)),
                          device="cpu", dtype=getattr(torch, options.hf_dtype))
    load_s = elapsed(started)
    labels = [classifier.model.config.id2label[i] for i in range(classifier.model.config.num_labels)]
    texts = [row.text for row in rows]

    def run_at(batch_size: int) -> list[TaskRowOutput]:
        answers = classifier(texts, batch_size=batch_size, top_k=None, truncation=True)
        outputs = []
        for row, scores in zip(rows, answers):
            by_label = {entry["label"]: entry["score"] for entry in scores}
            probs = [float(by_label[label]) for label in labels]
            outputs.append(TaskRowOutput(row.id, probs, labels[max(range(len(probs)), key=probs.__getitem__)]))
        return outputs

    return best_of("hf-pipeline", options, load_s, run_at, labels=labels)


def causal_lm_forward(rows: list, options: BenchOptions) -> SystemRun:
    import torch
    from transformers import AutoModelForCausalLM

    from batchgen.models.loader import reference_model_dir

    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(reference_model_dir(options.engine_args.model),
                                                 dtype=getattr(torch, options.hf_dtype)).eval()
    load_s = elapsed(started)
    ordered = sorted(rows, key=lambda row: len(row.token_ids))

    @torch.inference_mode()
    def run_at(batch_size: int) -> list[TaskRowOutput]:
        outputs = []
        for first in range(0, len(ordered), batch_size):
            batch = ordered[first:first + batch_size]
            width = max(len(row.token_ids) for row in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, row in enumerate(batch):  # right padding: position ids stay those of the text alone
                ids[i, :len(row.token_ids)] = torch.tensor(row.token_ids)
                mask[i, :len(row.token_ids)] = 1
            logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
            taken = logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # token t+1's logprob given those before
            for i, row in enumerate(batch):
                outputs.append(TaskRowOutput(row.id, taken[i, :len(row.token_ids) - 1].tolist()))
        return outputs

    return best_of("hf-forward", options, load_s, run_at)
