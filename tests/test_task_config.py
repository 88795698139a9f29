"""task: generate | embed | classify | score (issue 41), the job layer without a model: the `task` key and the
embed/classify/score sections derived from PoolingParams, their errors (one line naming the key), the output columns
per task, the fingerprint, the prompt building of each task (truncation, lm-eval's continuation split) and the summary
table."""
from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from batchgen.engine.request import PoolingParams, Result
from batchgen.job.config import JobConfigError, parse_job
from batchgen.job.input.source import MAX_CHARS_PER_TOKEN, PromptBuilder
from batchgen.job.output.schema import OUTPUT_COLUMNS, OutputOptions, error_mask, output_schema
from batchgen.job.prepare import output_options
from batchgen.job.run_summary import summary_table
from batchgen.job.task_config import TASK_FIELDS, TASK_SECTIONS


def job(**sections):
    return parse_job({"input": {"path": "in.parquet"}, "output": {"path": "out"}, **sections})


def error_of(**sections) -> str:
    with pytest.raises(JobConfigError) as info:
        job(**sections)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_task_is_a_top_level_key_of_the_engine_args():
    assert job().task == "generate" and job().engine.task == "generate"
    config = job(task="embed")
    assert config.engine.task == "embed" and config.to_dict()["task"] == "embed"
    assert "task" not in config.to_dict()["engine"]
    assert error_of(engine={"task": "embed"}).startswith("unknown key engine.task")
    assert error_of(task="summarize") == "task: expected one of generate | embed | classify | score, got 'summarize'"


def test_sections_are_pooling_params_fields():
    defaults = {f.name: f.default for f in dataclasses.fields(PoolingParams)}
    for task, cls in TASK_SECTIONS.items():
        names = [f.name for f in dataclasses.fields(cls)]
        assert names[:len(TASK_FIELDS[task])] == list(TASK_FIELDS[task])
        assert all(getattr(cls(), name) == defaults[name] for name in TASK_FIELDS[task])
    assert [f.name for f in dataclasses.fields(TASK_SECTIONS["score"])] == ["token_logprobs", "continuation_column"]
    config = job(task="embed", embed={"pooling": "cls", "normalize": False, "dimensions": 64, "truncate": False})
    assert config.embed == TASK_SECTIONS["embed"]("cls", False, 64, False)
    assert config.to_dict()["embed"] == {"pooling": "cls", "normalize": False, "dimensions": 64, "truncate": False}
    assert "sampling" not in config.to_dict() and "embed" not in job().to_dict()


@pytest.mark.parametrize("sections, message", [
    ({"task": "embed", "embed": {"pooling": "max"}}, "embed.pooling: expected one of mean | cls | last, got 'max'"),
    ({"task": "embed", "embed": {"dimensions": 0}}, "embed.dimensions: must be at least 1, got 0"),
    ({"task": "embed", "embed": {"dimensions": "64"}}, "embed.dimensions: expected an integer"),
    ({"task": "embed", "embed": {"normalize": "yes"}}, "embed.normalize: expected true or false, got 'yes'"),
    ({"task": "classify", "classify": {"truncate": 1}}, "classify.truncate: expected true or false, got 1"),
    ({"task": "score", "score": {"token_logprobs": "no"}}, "score.token_logprobs: expected true or false"),
    ({"task": "score", "score": {"continuation_column": " "}}, "score.continuation_column: must be a column name"),
    ({"task": "embed", "embed": {"pool": "cls"}}, "unknown key embed.pool (did you mean embed.pooling?)"),
    ({"task": "embed", "classify": {}}, "classify: this section is for task: classify, and the job's task is embed"),
    ({"embed": {"dimensions": 8}}, "embed: this section is for task: embed, and the job's task is generate"),
    ({"task": "score", "sampling": {"temperature": 0.5}},
     "sampling.temperature: task: score generates no text, so sampling does not apply"),
])
def test_errors_name_the_key(sections, message):
    assert message in error_of(**sections)


def test_chat_template_defaults_to_false_for_the_prefill_tasks():
    assert job().input.chat_template is True
    for task in ("embed", "classify", "score"):
        assert job(task=task).input.chat_template is False
    assert job(task="classify", input={"path": "in.parquet", "chat_template": True}).input.chat_template is True


def test_embed_and_classify_sort_by_length_unless_told():
    assert job(task="embed").input.sort == "length" and job(task="classify").input.sort == "length"
    assert job(task="score").input.sort == "prefix" and job().input.sort == "prefix"  # contexts share prefixes
    assert job(task="embed", input={"path": "in.parquet", "sort": "none"}).input.sort == "none"


def test_columns_per_task():
    def names(task, **options):
        return output_schema(pa.int64(), [("tag", pa.string())], OutputOptions(task=task, **options)).names

    timing = ["queue_s", "e2e_s", "arrival_time", "finish_time", "num_preemptions"]
    assert names("embed") == ["id", "embedding", "error", "prompt_tokens", "num_truncated_tokens", "cached_tokens",
                              *timing, "tag"]
    assert names("classify") == ["id", "label", "probs", "score", "error", "prompt_tokens", "num_truncated_tokens",
                                 "cached_tokens", *timing, "tag"]
    assert names("score") == ["id", "logprob_sum", "num_scored_tokens", "perplexity", "error", "prompt_tokens",
                              "cached_tokens", *timing, "tag"]
    assert names("score", token_logprobs=True)[1:5] == ["logprob_sum", "num_scored_tokens", "perplexity",
                                                        "token_logprobs"]
    assert names("embed", replica=True)[-2:] == ["replica", "tag"]
    generate = names("generate")
    assert "text" in generate and "ttft_s" in generate and "embedding" not in generate
    schema = output_schema(pa.int64(), [], OutputOptions(task="classify"))
    assert schema.field("probs").type == pa.list_(pa.float32()) and schema.field("score").type == pa.float64()
    assert set(OUTPUT_COLUMNS) >= set(names("score", token_logprobs=True)) - {"tag"}


def test_output_options_follow_the_job():
    config = job(task="score", score={"token_logprobs": True})
    assert output_options(config, {"n": None, "temperature": None}) == OutputOptions(task="score",
                                                                                     token_logprobs=True)
    assert output_options(job(), {"n": None}).samples  # generate still reads per-row sampling columns


def test_score_columns_are_read_from_the_prompt_logprobs():
    schema = output_schema(pa.int64(), [], OutputOptions(task="score", token_logprobs=True))
    from batchgen.job.output.schema import COLUMNS
    result = Result(request_id=0, text="", token_ids=[], finish_reason="stop", error=None, prompt_tokens=4,
                    output_tokens=0, cached_tokens=0, num_preemptions=0, arrival_time=0.0, first_scheduled_time=0.0,
                    first_token_time=None, finish_time=1.0, prompt_logprobs=[-1.0, -2.0, -3.0])
    values = {c.name: c.value(result) for c in COLUMNS if c.name in schema.names and c.name != "id"}
    assert values["logprob_sum"] == -6.0 and values["num_scored_tokens"] == 3
    assert values["perplexity"] == pytest.approx(7.38905609893065) and values["token_logprobs"] == [-1.0, -2.0, -3.0]
    error = Result.for_error(1, "bad", 0, 0.0)
    assert all(c.value(error) is None for c in COLUMNS if c.name in ("logprob_sum", "num_scored_tokens",
                                                                     "perplexity", "token_logprobs"))
    table = pa.table({"error": [None, "bad"]})
    assert error_mask(table).to_pylist() == [False, True]


def test_fingerprint_holds_the_task_and_its_section():
    from batchgen.job.prepare import job_fingerprint

    class Inputs:
        sources, files, row_counts, format = [], [], [], "parquet"

    class Target:
        class dtype:
            name = "float32"

    generate = job_fingerprint(job(), "m", Inputs(), Target())
    assert "task" not in generate and "sampling" in generate  # outputs written before `task` still resume
    embed = job_fingerprint(job(task="embed", embed={"dimensions": 8}), "m", Inputs(), Target())
    assert embed["task"] == "embed" and embed["embed"]["dimensions"] == 8 and "sampling" not in embed
    from batchgen.job.output.resume import describe_changes
    assert describe_changes(generate, embed) == "input, task, embed, sampling changed"  # refused, naming them
    other = job_fingerprint(job(task="embed", embed={"dimensions": 16}), "m", Inputs(), Target())
    assert describe_changes(embed, other) == "embed changed"


class FakeTokenizer:
    """Whitespace words; token i is word i's length (no special tokens)."""

    def __call__(self, texts, add_special_tokens, split_special_tokens=False):
        return {"input_ids": [[len(word) for word in text.split(" ") if word] for text in texts]}


class Inputs:
    column_types = {"prompt": pa.string(), "cont": pa.string(), "temperature": pa.float64()}


def builder(config, max_model_len=8):
    return PromptBuilder(config, Inputs(), FakeTokenizer(), max_model_len)


def test_embed_cuts_a_long_text_instead_of_refusing_it():
    long = "ab " * (8 * MAX_CHARS_PER_TOKEN)
    rows = builder(job(task="embed")).build([(0, {"prompt": long, "temperature": 9.0})])
    assert rows[0].error is None and rows[0].pooling == PoolingParams()
    assert len(rows[0].token_ids) == 8 * MAX_CHARS_PER_TOKEN // 3 + 1  # the text cut, not tokenized whole
    refused = builder(job(task="embed", embed={"truncate": False})).build([(0, {"prompt": long})])
    assert "it was not tokenized" in refused[0].error
    generate = builder(job(input={"path": "in.parquet", "chat_template": False})).build([(0, {"prompt": long})])
    assert "it was not tokenized" in generate[0].error


def test_score_split_is_lm_evals():
    config = job(task="score", score={"continuation_column": "cont"})
    rows = builder(config, 64).build([(0, {"prompt": "one two ", "cont": "three"}),
                                      (1, {"prompt": "one", "cont": ""}),
                                      (2, {"prompt": "  ", "cont": "x"}),
                                      (3, {"prompt": "one", "cont": None})])
    assert rows[0].token_ids == [3, 3, 5] and rows[0].pooling.score_from == 2 and rows[0].pooling.token_logprobs
    assert rows[1].error == "continuation is empty (column 'cont')"
    assert rows[2].error == "context is empty (column 'prompt')"
    assert rows[3].error == "continuation is null (column 'cont')"
    whole = builder(job(task="score"), 64).build([(0, {"prompt": "one two", "cont": "x"})])
    assert whole[0].token_ids == [3, 3] and whole[0].pooling.score_from == 1
    too_long = builder(job(task="score"), 2).build([(0, {"prompt": "a b c"})])
    assert too_long[0].error.startswith("prompt is too long: 3 tokens")
    fits = builder(job(task="score"), 3).build([(0, {"prompt": "a b c"})])
    assert fits[0].error is None  # nothing is generated: the whole context may be scored


def summary(**extra):
    return {"rows": 3, "rows_ok": 3, "rows_error": 0, "prompt_tokens": 30, "output_tokens": 0, "cached_tokens": 0,
            "prefix_cache_hit_rate": 0.0, "wall_s": 2.0, "generation_s": 1.0, "rows_this_run": 3, "preemptions": 0,
            "peak_memory_bytes": 2**30, "output_tokens_per_s": 0.0, **extra}


def test_the_summary_table_names_the_task():
    embed = summary_table(summary(task="embed", embedding_dimensions=384, truncated_rows=2), "out")
    assert "embed: embeddings of 384 dimensions; 2 rows truncated" in embed and "output tokens" not in embed
    classify = summary_table(summary(task="classify", labels=["neg", "pos"], truncated_rows=0), "out")
    assert "classify: labels neg, pos" in classify
    assert "score: 1,234 tokens scored" in summary_table(summary(task="score", scored_tokens=1234), "out")
    assert "output tokens" in summary_table(summary(task="generate"), "out")
