"""Speculative decoding (engine/speculative/): the proposer and the rule that keeps guesses, then the engine on the
default model (fp32) with and without prompt lookup: the same tokens and logprobs for greedy, seeded, stop-string,
logprobs, constrained, n-sample and `choice` rows, through preemption and prefix-cache hits; the batch rule; and
`batchgen run` with `engine.speculative`."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.speculative import Speculator, SpeculativeConfig
from batchgen.engine.speculative.ngram import propose_ngram
from batchgen.engine.speculative.verify import confirmed_rows
from batchgen.engine.sequence import Sequence
from batchgen.models.quantization import WEIGHT_ONLY_MAX_ROWS
from cli_runs import read, run_cli

NGRAM = {"method": "ngram", "num_tokens": 4}
# Rows whose answers copy the prompt (prompt lookup's case) and rows that do not.
COPYING = ["Repeat this list exactly, item by item: apples, pears, plums, cherries, grapes, lemons, limes, figs.",
           "Extract the names from: Yesterday Alice Johnson met Bob Smith and Carol White at the station. Names:",
           "Copy the address verbatim: 221B Baker Street, Marylebone, London NW1 6XE, United Kingdom."]
FREE = ["Write one sentence about the sea.", "What is the capital of France? Explain briefly."]


def test_ngram_takes_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(tokens, 3, 2, 4) == [7, 8, 5]  # "2 3" last occurred before 7 8 5
    assert propose_ngram(tokens + [7], 2, 2, 4) == [8, 5]  # "2 3 7" beats the shorter match
    assert propose_ngram([1, 2, 3, 4], 3, 2, 4) == []  # no earlier occurrence
    assert propose_ngram([5, 6, 5, 6], 4, 2, 2) == [5, 6]  # what follows may run into the suffix itself


def test_guesses_stand_up_to_the_first_draw_that_differs():
    seq = Sequence("r", [1, 2], 2, SamplingParams(), 0, 0.0)
    seq.draft_token_ids = [5, 6, 7]
    other = Sequence("o", [1], 1, SamplingParams(), 0, 0.0)
    seqs, offsets = [seq] * 4 + [other], [0, 1, 2, 3, 0]
    assert confirmed_rows(seqs, offsets, [5, 6, 9, 7, 3]) == [0, 1, 2, 4]  # 5, 6 stood; 9 is its own draw
    assert confirmed_rows(seqs, offsets, [4, 6, 7, 8, 3]) == [0, 4]  # the first guess fell
    assert confirmed_rows(seqs, offsets, [5, 6, 7, 8, 3]) == [0, 1, 2, 3, 4]  # all stood, and one more token


def _requests(tokenizer) -> list[Request]:
    def ids(text):
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=False))
    rows = [(text, SamplingParams(max_tokens=40, temperature=0.0)) for text in COPYING + FREE]
    rows += [(COPYING[0], SamplingParams(max_tokens=40, temperature=0.8, seed=11, n=2)),  # seeded, two samples
             (COPYING[1], SamplingParams(max_tokens=40, temperature=0.0, stop=["Carol"])),
             (COPYING[2], SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)),
             (COPYING[2], SamplingParams(max_tokens=24, temperature=0.0, regex=r"[0-9]+[A-Z] [A-Za-z ,]+")),
             (COPYING[0], SamplingParams(max_tokens=8, temperature=0.0, choice=["apples", "pears"]))]
    return [Request(i, ids(text), params) for i, (text, params) in enumerate(rows)]


def _run(model_dir, speculative, only: tuple[int, ...] | None = None, **engine) -> tuple[dict, dict, list]:
    args = dict(model=str(model_dir), dtype="float32", kv_cache_memory="64MiB", batch_invariant=True,
                max_num_seqs=16, speculative=speculative)
    engine = Engine(EngineArgs(**{**args, **engine}))
    requests = [r for r in _requests(engine.tokenizer) if only is None or r.request_id in only]
    for request in requests:  # prompts repeat: later ones find the earlier ones' blocks in the prefix cache
        engine.add_request(request)
    results, steps = {}, []
    while engine.has_unfinished():
        for result in engine.step():
            results[(result.request_id, result.sample_index)] = result
        if engine.last_step is not None:
            steps.append((engine.stats()["num_running"], engine.last_step))
    return results, engine.stats(), steps


def _same(a: dict, b: dict) -> None:
    """b's results (all of a's, or some) equal a's."""
    assert set(b) <= set(a) and b
    for key in b:
        assert a[key].error is None, a[key].error
        assert (a[key].token_ids, a[key].text, a[key].finish_reason, a[key].logprobs) == \
               (b[key].token_ids, b[key].text, b[key].finish_reason, b[key].logprobs), key


@pytest.fixture(scope="module")
def plain(default_model_dir):
    return _run(default_model_dir, None)


def test_prompt_lookup_changes_no_token(plain, default_model_dir):
    """Greedy, seeded (two samples), a stop string, logprobs, a regex and a choice row: the same with prompt
    lookup, which guessed and had guesses stand on the copying rows."""
    results, stats, _ = _run(default_model_dir, NGRAM)
    assert results.keys() == plain[0].keys()
    _same(plain[0], results)
    assert stats["spec_draft_tokens"] > 50 and stats["spec_acceptance_rate"] > 0.3, stats
    assert plain[1]["spec_draft_tokens"] == 0 and plain[1]["speculative"] is None
    assert stats["num_steps"] < plain[1]["num_steps"]


def test_preempted_and_cached_sequences_speculate_the_same(plain, default_model_dir):
    """A KV pool too small for the batch: sequences are preempted and recomputed from the prefix cache, guesses'
    slots are rolled back across block edges (block_size 4); still the same tokens."""
    results, stats, _ = _run(default_model_dir, {**NGRAM, "num_tokens": 6}, kv_cache_memory="7MiB", block_size=4)
    _same(plain[0], results)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert stats["spec_accepted_tokens"] > 0


def test_large_batches_do_not_speculate(plain, default_model_dir):
    results, stats, steps = _run(default_model_dir, {**NGRAM, "max_batch": 3})
    _same(plain[0], results)
    assert all(step.num_draft_tokens == 0 for running, step in steps if running > 3)
    assert any(step.num_draft_tokens > 0 for _, step in steps), steps  # the batch thins out at the end


def test_small_steps_do_not_leave_the_int8_weight_only_kernel(default_int8_dir):
    """The default model as `batchgen run` holds it (int8), in bf16, runs its Linears weight-only on an int8 kernel
    up to WEIGHT_ONLY_MAX_ROWS rows: a decode step of 4 sequences, whose guesses would take it past them, guesses
    nothing; 1-3 sequences and more than 4 guess (6 copying rows, which guess all they may)."""
    engine = Engine(EngineArgs(model=str(default_int8_dir), dtype="bfloat16", kv_cache_memory="64MiB",
                               max_num_seqs=16, speculative=NGRAM))
    template = engine.tokenizer.apply_chat_template
    for i, text in enumerate(COPYING * 2):
        ids = engine.tokenizer.encode(template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=False))
        engine.add_request(Request(i, ids, SamplingParams(max_tokens=32, temperature=0.0)))
    drafts = {}  # decoding sequences -> guesses of each such decode step
    while engine.has_unfinished():
        engine.step()
        step = engine.last_step
        if step is not None and step.num_prefill_tokens == 0:
            drafts.setdefault(step.num_decodes, []).append(step.num_draft_tokens)
    assert drafts.get(4) and not any(drafts[4]), drafts
    assert any(any(drafts.get(n, [])) for n in (1, 2, 3)) and any(any(drafts.get(n, [])) for n in (5, 6)), drafts


def test_the_guesses_a_step_allows():
    capped = Speculator(SpeculativeConfig("ngram", num_tokens=4), 512, kernel_rows=WEIGHT_ONLY_MAX_ROWS)
    assert [capped.guesses(n) for n in (1, 3, 4, 5, 8, 9, 32, 33)] == [4, 4, 0, 4, 4, 4, 4, 0]
    plain = Speculator(SpeculativeConfig("ngram", num_tokens=4), 512)
    assert [plain.guesses(n) for n in (1, 8, 32, 33)] == [4, 4, 4, 0]


def test_settings_are_checked_by_key():
    with pytest.raises(ValueError, match="speculative.method"):
        EngineArgs(speculative={"method": "medusa"}).validate()
    with pytest.raises(ValueError, match="speculative.model"):
        EngineArgs(speculative={"method": "draft"}).validate()
    with pytest.raises(ValueError, match="speculative.max_match"):
        EngineArgs(speculative={"method": "ngram", "min_match": 3, "max_match": 2}).validate()


def _job(root, name, model_dir, source, **engine) -> object:
    job = {"model": str(model_dir), "dtype": "float32",
           "input": {"path": str(source), "id_column": "key", "prompt_column": "text"},
           "sampling": {"max_tokens": 32, "temperature": 0.0},
           "engine": {"kv_cache_memory": "128MiB", **engine},
           "output": {"path": str(root / name)}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_run_with_prompt_lookup(tmp_path, default_model_dir):
    """`batchgen run` with engine.speculative: the same texts as without, the acceptance rate in _SUCCESS and the
    summary; a mistake in the section names its key."""
    import polars as pl
    pl.DataFrame({"key": list(range(6)), "text": (COPYING + FREE + COPYING)[:6]}).write_parquet(tmp_path / "in.parquet")
    plain_run = run_cli(_job(tmp_path, "plain", default_model_dir, tmp_path / "in.parquet"))
    assert plain_run.returncode == 0, plain_run.stderr[-2000:]
    job = _job(tmp_path, "spec", default_model_dir, tmp_path / "in.parquet", speculative=NGRAM)
    spec_run = subprocess.run([sys.executable, "-m", "batchgen", "run", str(job)], capture_output=True, text=True,
                              timeout=600)
    assert spec_run.returncode == 0, spec_run.stderr[-2000:]
    assert re.search(r"speculative +ngram: [0-9,]+ tokens guessed, [0-9,]+ stood \([0-9]+% acceptance rate\)",
                     spec_run.stderr), spec_run.stderr[-2000:]
    assert read(tmp_path / "spec").sort("id")["text"].to_list() == read(tmp_path / "plain").sort("id")["text"].to_list()
    stats = json.loads((tmp_path / "spec" / "_SUCCESS").read_text())["engine_stats"]
    assert stats["speculative"] == "ngram" and stats["spec_accepted_tokens"] > 0, stats
    bad = run_cli(_job(tmp_path, "bad", default_model_dir, tmp_path / "in.parquet",
                       speculative={"method": "ngram", "num_tokens": 0}))
    assert bad.returncode == 2 and "engine.speculative.num_tokens" in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr


def test_a_draft_model_changes_no_token(plain, default_model_dir, default_int8_dir):
    """The default model's int8 (W8A8) conversion drafting for its fp32 weights: the same tokens as without, most
    guesses standing; its weights and KV counted in the engine's memory."""
    results, stats, _ = _run(default_model_dir, {"method": "draft", "model": str(default_int8_dir), "num_tokens": 3},
                             only=(0, 1))
    _same(plain[0], results)
    assert stats["spec_acceptance_rate"] > 0.5 and stats["spec_draft_model_bytes"] > 0, stats


def test_a_draft_model_must_share_the_tokenizer(default_model_dir, tiny_gemma3_dir):
    with pytest.raises(ValueError, match="speculative.model .* (does not share the model's tokenizer|sliding-window)"):
        Engine(EngineArgs(model=str(default_model_dir), dtype="float32", kv_cache_memory="64MiB",
                          speculative={"method": "draft", "model": str(tiny_gemma3_dir)}))


def test_plan_says_when_speculation_runs_and_what_a_draft_holds(tmp_path, default_model_dir, default_int8_dir):
    import polars as pl
    pl.DataFrame({"key": [0, 1, 2], "text": COPYING}).write_parquet(tmp_path / "in.parquet")
    ngram = _job(tmp_path, "ngram", default_model_dir, tmp_path / "in.parquet", speculative=NGRAM)
    done = subprocess.run([sys.executable, "-m", "batchgen", "plan", str(ngram), "--no-probe"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "speculative: prompt lookup (2..4-gram), up to 4 guessed tokens" in done.stdout
    assert "on throughout (at most 3 sequences at once)" in done.stdout, done.stdout
    draft = _job(tmp_path, "draft", default_model_dir, tmp_path / "in.parquet", max_num_seqs=64,
                 speculative={"method": "draft", "model": str(default_int8_dir)})
    done = subprocess.run([sys.executable, "-m", "batchgen", "plan", str(draft), "--no-probe"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"draft model {default_int8_dir}" in done.stdout and re.search(r"draft model +[0-9.,]+ [MG]iB", done.stdout)
