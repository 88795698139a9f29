"""What each constraint costs, side by side in one process on the default model (ratios, not absolute times: the
machine may be shared).

    PYTHONPATH=$PWD:$PWD/kernels python dev/constraint_costs.py [--rows 64] [--dtype auto] [--repeats 2]

- choice: the bench's labeling rows (a ~250-token shared instruction + ~100 tokens each) answered by exact choice
  scoring over the instruction's 4 labels, against free greedy answers of up to 8 tokens; and the tokens computed
  against one prefill of each prompt.
- json_schema / regex: rows generated under the constraint, against the same rows unconstrained and forced to the
  same number of output tokens (ignore_eos, min_tokens = max_tokens = the constrained length), so the difference
  is the grammar's work: matcher updates, bitmask fills and the masked sampling.
Each pair runs `--repeats` times interleaved on a fresh engine each time; the best wall time of each is kept. The
times start after add_request: the grammar's one-off setup (vocabulary tables, compile) is reported on its own.
"""
from __future__ import annotations

import argparse
import json
import time

from batchgen.bench.workloads import LABELING_LABELS, PromptTokenizer, synthetic_workload
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "score": {"type": "integer", "minimum": 1, "maximum": 5},
    "topics": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    "summary": {"type": "string", "maxLength": 60}},
    "required": ["sentiment", "score", "topics", "summary"]}
REGEX = r"(positive|negative|neutral), score [1-5]: [a-z ,]{5,40}\."


def run(args: EngineArgs, requests: list[Request]) -> tuple[float, list, int, float]:
    """Wall seconds of stepping the requests to the end on a fresh engine, the results, the tokens computed, and
    the seconds add_request took (for a constrained request: the vocabulary's tables, once per engine, and the
    compile, once per distinct constraint)."""
    engine = Engine(args)
    started = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    setup_s = time.perf_counter() - started
    results, computed = [], 0
    started = time.perf_counter()
    while engine.has_unfinished():
        results += engine.step()
        if engine.last_step is not None:
            computed += engine.last_step.num_prefill_tokens + engine.last_step.num_decodes
    return time.perf_counter() - started, results, computed, setup_s


def best_pair(args: EngineArgs, first: list[Request], second: list[Request], repeats: int):
    best = [None, None]
    for _ in range(repeats):
        for i, requests in enumerate((first, second)):
            outcome = run(args, requests)
            if best[i] is None or outcome[0] < best[i][0]:
                best[i] = outcome
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="write the figures as JSON here")
    options = parser.parse_args()
    args = EngineArgs(model="default", dtype=options.dtype, kv_cache_memory="1GiB")
    probe = Engine(args)
    tokenizer = probe.tokenizer
    figures = {"dtype": str(probe.dtype).removeprefix("torch."), "rows": options.rows}
    del probe

    # choice against free labels
    rows = sorted(synthetic_workload("labeling", options.rows, 0, tokenizer).rows, key=lambda r: r.token_ids)
    free = [Request(r.id, r.token_ids, SamplingParams(max_tokens=8, temperature=0.0)) for r in rows]
    scored = [Request(r.id, r.token_ids, SamplingParams(choice=LABELING_LABELS, temperature=0.0)) for r in rows]
    (free_s, _, free_tokens, _), (choice_s, _, choice_tokens, _) = best_pair(args, free, scored, options.repeats)
    prompt_tokens = sum(len(r.token_ids) for r in rows)
    figures["choice"] = {"free_s": free_s, "choice_s": choice_s, "ratio": choice_s / free_s,
                         "free_tokens_computed": free_tokens, "choice_tokens_computed": choice_tokens,
                         "prompt_tokens": prompt_tokens}

    # grammar-constrained generation against the same lengths unconstrained
    tokenize = PromptTokenizer(tokenizer)
    reviews = [r for r in synthetic_workload("labeling", options.rows, 1, tokenizer).rows]
    texts = [tokenizer.decode(r.token_ids[-120:], skip_special_tokens=True) for r in reviews]
    for key, value, ask in (("json_schema", json.dumps(SCHEMA), "Describe the review as JSON."),
                            ("regex", REGEX, "Give its sentiment, a score from 1 to 5 and a few words.")):
        prompts = [tokenize(f"{ask}\n{text}") for text in texts]
        constrained = [Request(i, p, SamplingParams(max_tokens=96, temperature=0.0, **{key: value}))
                       for i, p in enumerate(prompts)]
        _, results, _, _ = run(args, constrained)
        lengths = {r.request_id: r.output_tokens for r in results}
        forced = [Request(i, p, SamplingParams(max_tokens=lengths[i], min_tokens=lengths[i], ignore_eos=True,
                                               temperature=0.0)) for i, p in enumerate(prompts)]
        (free_s, _, _, _), (masked_s, _, _, setup_s) = best_pair(args, forced, constrained, options.repeats)
        output_tokens = sum(lengths.values())
        figures[key] = {"free_s": free_s, "constrained_s": masked_s, "ratio": masked_s / free_s,
                        "output_tokens": output_tokens, "setup_s": setup_s,
                        "overhead_ms_per_token": (masked_s - free_s) / output_tokens * 1e3}

    c = figures["choice"]
    print(f"dtype {figures['dtype']}, {options.rows} rows, best of {options.repeats}")
    print("| constraint | unconstrained s | constrained s | ratio | notes |")
    print("|---|---|---|---|---|")
    print(f"| choice (4 labels) | {c['free_s']:.2f} (free greedy, up to 8 tokens) | {c['choice_s']:.2f} | "
          f"{c['ratio']:.2f} | tokens computed {c['choice_tokens_computed']:,} vs {c['free_tokens_computed']:,} "
          f"(prompts {c['prompt_tokens']:,}, before the prefix cache) |")
    for key in ("json_schema", "regex"):
        f = figures[key]
        print(f"| {key} | {f['free_s']:.2f} (same lengths) | {f['constrained_s']:.2f} | {f['ratio']:.2f} | "
              f"{f['output_tokens']:,} output tokens; {f['overhead_ms_per_token']:+.2f} ms per token; once per "
              f"run: {f['setup_s']:.2f} s of vocabulary tables and compile, not in these times |")
    if options.out:
        with open(options.out, "w") as file:
            json.dump(figures, file, indent=2)


if __name__ == "__main__":
    main()
