"""job.yaml parsing: defaults, types, overrides, cross-key rules; every error names its key."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import yaml

from batchgen.engine import EngineArgs, SamplingParams
from batchgen.engine.errors import SettingError
from batchgen.job.config import (ENGINE_KEYS, JOB_SAMPLING_DEFAULTS, TOP_LEVEL_KEYS,
                                 JobConfigError, load_job, parse_job, template_columns)
from batchgen.job.job_file import apply_override

README = Path(__file__).resolve().parents[1] / "README.md"

MINIMAL = "input:\n  path: data/in.parquet\noutput:\n  path: out/x\n"


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def job(**sections):
    raw = {"input": {"path": "in.parquet"}, "output": {"path": "out"}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return parse_job(raw)


def error_of(**sections) -> str:
    with pytest.raises(JobConfigError) as info:
        job(**sections)
    return str(info.value)


def test_defaults_follow_the_issue_contract(tmp_path):
    config = load_job(write(tmp_path, MINIMAL))
    assert (config.model, config.dtype, config.device) == ("default", "auto", "auto")
    assert config.input.prompt_column == "prompt" and config.input.chat_template is True
    assert config.input.id_column is None and config.input.template is None
    s = config.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.stop) == (256, 0.0, 1.0, 0, 0.0, None, ())
    e = config.engine
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.block_size, e.kv_cache_memory, e.enable_prefix_caching,
            config.input.sort) == (256, 4096, 16, None, True, "prefix")
    assert (config.output.keep_columns, config.output.order) == ((), "input")


def test_full_issue_example_parses(tmp_path):
    text = """
model: default
dtype: auto
device: auto
input:
  path: data/samples/prompts.parquet
  id_column: id
  prompt_column: prompt
  messages_column: null
  system_prompt: null
  system_column: null
  template: null
  chat_template: true
sampling:
  max_tokens: 256
  temperature: 0.0
  top_p: 1.0
  top_k: 0
  min_p: 0.0
  seed: null
  stop: []
engine:
  max_num_seqs: 256
  max_num_batched_tokens: 4096
  block_size: 16
  kv_cache_memory: 2GiB
  enable_prefix_caching: true
  sort: prefix
output:
  path: out/job
  keep_columns: []
  order: input
"""
    config = load_job(write(tmp_path, text))
    assert config.input.id_column == "id" and config.output.path == "out/job"
    assert config.to_dict()["sampling"]["stop"] == []


def test_config_is_frozen(tmp_path):
    config = load_job(write(tmp_path, MINIMAL))
    with pytest.raises(Exception):
        config.model = "other"  # type: ignore[misc]


def test_overrides_are_yaml_scalars(tmp_path):
    config = load_job(write(tmp_path, MINIMAL), ["engine.max_num_seqs=64", "output.path=out/run2",
                                                  "sampling.temperature=0.7", "sampling.seed=null",
                                                  "engine.enable_prefix_caching=false", "sampling.stop=[a, b]",
                                                  "input.system_prompt=Be brief: answer=short"])
    assert config.engine.max_num_seqs == 64 and isinstance(config.engine.max_num_seqs, int)
    assert config.output.path == "out/run2"
    assert config.sampling.temperature == 0.7 and config.sampling.seed is None
    assert config.engine.enable_prefix_caching is False
    assert config.sampling.stop == ("a", "b")
    assert config.input.system_prompt == "Be brief: answer=short"  # split at the first '=' only


def test_override_creates_missing_section(tmp_path):
    config = load_job(write(tmp_path, MINIMAL), ["sampling.max_tokens=8"])
    assert config.sampling.max_tokens == 8


def test_max_tokens_null_is_until_the_context_ends(tmp_path):
    config = load_job(write(tmp_path, MINIMAL), ["sampling.max_tokens=null"])
    assert config.sampling.max_tokens is None and config.sampling.params().max_tokens is None
    assert config.sampling.params(max_tokens=7).max_tokens == 7  # a row's own value still counts
    with pytest.raises(JobConfigError, match="sampling.max_tokens: max_tokens must be at least 1"):
        load_job(write(tmp_path, MINIMAL), ["sampling.max_tokens=0"])


@pytest.mark.parametrize("item, fragment", [
    ("engine.max_num_seqs", "expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
    ("engine..x=3", "expected KEY=VALUE"),
    ("engine.max_num_seqs=many", "engine.max_num_seqs: expected an integer"),
    ("engine.nope=1", "unknown key engine.nope"),
    ("output.path.deeper=1", "--set output.path.deeper: output.path is not a section"),
])
def test_bad_overrides_name_the_key(tmp_path, item, fragment):
    with pytest.raises(JobConfigError, match=fragment.replace(".", r"\.")):
        load_job(write(tmp_path, MINIMAL), [item])


def test_unknown_keys_are_rejected_with_a_suggestion():
    assert "unknown key sampling.temprature (did you mean sampling.temperature?)" in \
        error_of(sampling={"temprature": 0.5})
    assert "unknown key colour" in error_of(colour="red")
    assert "unknown key output.kep_columns" in error_of(output={"kep_columns": []})


@pytest.mark.parametrize("sections, message", [
    ({"model": 3}, "model: expected a string, got 3"),
    ({"model": ""}, "model: must not be empty"),
    ({"dtype": "fp8"}, "dtype: expected one of auto | float32 | bfloat16 | float16, got 'fp8'"),
    ({"device": "tpu"}, "device: expected one of auto | cpu | cuda"),
    ({"sampling": {"max_tokens": "many"}}, "sampling.max_tokens: expected an integer, got 'many'"),
    ({"sampling": {"max_tokens": 2.5}}, "sampling.max_tokens: expected an integer, got 2.5"),
    ({"sampling": {"max_tokens": True}}, "sampling.max_tokens: expected an integer, got True"),
    ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens: max_tokens must be at least 1"),
    ({"sampling": {"temperature": "hot"}}, "sampling.temperature: expected a number, got 'hot'"),
    ({"sampling": {"temperature": -1}}, "sampling.temperature: temperature must be >= 0"),
    ({"sampling": {"top_p": 0}}, "sampling.top_p: top_p must be in (0, 1]"),
    ({"sampling": {"min_p": 2}}, "sampling.min_p: min_p must be in [0, 1]"),
    ({"sampling": {"seed": 1.5}}, "sampling.seed: expected an integer"),
    ({"sampling": {"stop": [1]}}, "sampling.stop[0]: expected a string, got 1"),
    ({"sampling": "hot"}, "sampling: expected a mapping of keys, got 'hot'"),
    ({"engine": {"sort": "random"}}, "engine.sort: expected one of prefix | length | none"),
    ({"engine": {"enable_prefix_caching": "yes"}}, "engine.enable_prefix_caching: expected true or false"),
    ({"engine": {"kv_cache_memory": [2]}}, "engine.kv_cache_memory: expected a string or an integer, got a list"),
    ({"input": {"path": 5}}, "input.path: expected a string, got 5"),
    ({"input": {"path": " "}}, "input.path: must not be empty"),
    ({"input": {"chat_template": "yes"}}, "input.chat_template: expected true or false"),
    ({"input": {"chat_template": "{% for m in messages %}"}}, "input.chat_template: not a valid Jinja template"),
    ({"input": {"id_column": ""}}, "input.id_column: must be a column name"),
    ({"input": {"sort_window": 0}}, "input.sort_window: must be at least 1"),
    ({"output": {"order": "random"}}, "output.order: expected one of input | completion"),
    ({"output": {"keep_columns": ["text"]}}, "output.keep_columns: 'text' clashes with an output column"),
    ({"output": {"keep_columns": ["a", "a"]}}, "output.keep_columns: 'a' is listed twice"),
    ({"output": {"rows_per_part": 0}}, "output.rows_per_part: must be at least 1"),
])
def test_wrong_values_name_the_key(sections, message):
    assert message in error_of(**sections)


def test_missing_required_keys():
    with pytest.raises(JobConfigError, match="missing key input.path"):
        parse_job({"output": {"path": "o"}})
    with pytest.raises(JobConfigError, match="missing key output.path"):
        parse_job({"input": {"path": "i"}})


@pytest.mark.parametrize("input_section, message", [
    ({"messages_column": "m", "template": "{a}"}, "input.template: cannot be combined with input.messages_column"),
    ({"system_prompt": "s", "system_column": "c"}, "input.system_column: set input.system_prompt or"),
    ({"chat_template": False, "messages_column": "m"}, "input.messages_column: needs input.chat_template: true"),
    ({"chat_template": False, "system_prompt": "s"}, "input.system_prompt: needs input.chat_template: true"),
    ({"template": "{}"}, "input.template: name a column inside each pair of braces"),
    ({"template": "{0}"}, "input.template: name a column inside each pair of braces"),
    ({"template": "no fields"}, "input.template: reads no column"),
    ({"template": "{text"}, "input.template: expected '}' before end of string"),
])
def test_prompt_building_rules(input_section, message):
    assert message in error_of(input=input_section)


def test_template_columns_in_order_of_first_use():
    assert template_columns("Summarize:\n{text}\n({source}, {text})") == ["text", "source"]
    assert template_columns("{{literal}} {name}") == ["name"]


def test_yaml_and_file_errors_are_one_line(tmp_path):
    with pytest.raises(JobConfigError, match="job file not found"):
        load_job(tmp_path / "missing.yaml")
    bad = write(tmp_path, "input:\n  path: [unclosed\n")
    with pytest.raises(JobConfigError) as info:
        load_job(bad)
    assert "invalid YAML (line" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(JobConfigError, match="must be a mapping of keys, got list"):
        load_job(write(tmp_path, "- a\n- b\n"))


def test_apply_override_on_null_section():
    raw = {"sampling": None}
    apply_override(raw, "sampling.seed=7")
    assert raw == {"sampling": {"seed": 7}}


def test_sampling_params_carry_the_job_values():
    config = job(sampling={"max_tokens": 5, "stop": "###", "seed": 3})
    params = config.sampling.params(temperature=0.5)
    assert (params.max_tokens, params.stop, params.seed, params.temperature) == (5, ["###"], 3, 0.5)


# -- the engine and sampling sections follow EngineArgs and SamplingParams -------------------------------------------

def test_engine_keys_are_engine_args_fields_with_their_defaults():
    assert list(ENGINE_KEYS) == [f.name for f in dataclasses.fields(EngineArgs)
                                 if f.name not in TOP_LEVEL_KEYS] + ["sort"]  # input.sort's old name
    assert job().engine == EngineArgs()
    config = job(model="m.gguf", dtype="float32", device="cpu", engine={"max_num_seqs": 8})
    assert config.engine == EngineArgs(model="m.gguf", dtype="float32", device="cpu", max_num_seqs=8)
    assert (config.model, config.dtype, config.device) == ("m.gguf", "float32", "cpu")
    assert set(config.to_dict()["engine"]) == set(ENGINE_KEYS) - {"sort"}


def test_sampling_keys_are_sampling_params_fields_with_the_job_defaults():
    sampling = job().sampling
    assert [f.name for f in dataclasses.fields(sampling)] == [f.name for f in dataclasses.fields(SamplingParams)]
    assert sampling.params() == SamplingParams(**JOB_SAMPLING_DEFAULTS)
    assert JOB_SAMPLING_DEFAULTS == {"max_tokens": 256, "temperature": 0.0}


def test_keys_that_came_with_the_derivation():
    config = job(sampling={"skip_special_tokens": False}, engine={"attention_backend": "torch"})
    assert config.sampling.params().skip_special_tokens is False and config.engine.attention_backend == "torch"
    assert "engine.attention_backend: attention_backend must be one of auto, torch, triton, cpu; got 'cuda'" in \
        error_of(engine={"attention_backend": "cuda"})
    assert "sampling.skip_special_tokens: expected true or false" in error_of(sampling={"skip_special_tokens": 1})


def test_engine_seed_is_settable():
    config = job(engine={"seed": 7})
    assert config.engine.seed == 7 and config.to_dict()["engine"]["seed"] == 7
    assert job().engine.seed == EngineArgs().seed
    assert "engine.seed: seed must be a non-negative integer, got -1" in error_of(engine={"seed": -1})
    assert "engine.seed: expected an integer, got 'x'" in error_of(engine={"seed": "x"})


def raising(key: str, message: str):
    def validate(self):
        raise SettingError(key, message)
    return validate


def test_setting_errors_map_to_job_keys_by_their_key_not_their_text(monkeypatch):
    monkeypatch.setattr(EngineArgs, "validate", raising("max_num_batched_tokens", "reworded: too few tokens"))
    assert error_of() == "engine.max_num_batched_tokens: reworded: too few tokens"
    monkeypatch.setattr(EngineArgs, "validate", raising("dtype", "fp8 is not supported here"))
    assert error_of() == "dtype: fp8 is not supported here"  # model, dtype and device are top-level keys
    monkeypatch.setattr(EngineArgs, "validate", raising("device", "device: no such device"))
    assert error_of() == "device: no such device"  # not "device: device: ..."
    monkeypatch.undo()
    monkeypatch.setattr(SamplingParams, "validate", raising("top_k", "top-k wording changed"))
    assert error_of() == "sampling.top_k: top-k wording changed"


def test_setting_errors_from_the_engine_at_load_are_job_errors(monkeypatch):
    import batchgen.engine
    from batchgen.job.executors.local import load_engine
    from batchgen.job.prepare import PreparedJob

    config = job()
    prepared = PreparedJob(config, None, {}, None)

    def engine_raising(exc):
        def construct(args):
            raise exc
        return construct

    monkeypatch.setattr(batchgen.engine, "open_engine",
                        engine_raising(SettingError("kv_cache_memory", "pool too small")), raising=False)
    with pytest.raises(JobConfigError, match=r"^engine\.kv_cache_memory: pool too small$"):
        load_engine(prepared)
    monkeypatch.setattr(batchgen.engine, "open_engine", engine_raising(ValueError("kv_cache_memory: odd")),
                        raising=False)
    with pytest.raises(ValueError) as info:  # a plain ValueError is a runtime failure, not a job error
        load_engine(prepared)
    assert not isinstance(info.value, JobConfigError)


# -- input.sort and the deprecated engine.sort ------------------------------------------------------------------------

def test_input_sort():
    assert job().input.sort == "prefix"
    assert job(input={"sort": "length"}).input.sort == "length"
    assert "input.sort: expected one of prefix | length | none, got 'random'" in error_of(input={"sort": "random"})


def test_engine_sort_still_works_with_a_deprecation_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="batchgen.job.config"):
        config = job(engine={"sort": "none"})
    assert config.input.sort == "none" and "sort" not in config.to_dict()["engine"]
    assert [r.getMessage() for r in caplog.records] == ["engine.sort is deprecated: write input.sort: none instead"]
    caplog.clear()
    assert job(engine={"sort": "length"}, input={"sort": "length"}).input.sort == "length"  # the same: fine
    assert len(caplog.records) == 1
    assert "engine.sort: 'none' conflicts with input.sort: 'length'" in \
        error_of(engine={"sort": "none"}, input={"sort": "length"})


# -- the README's job file reference ----------------------------------------------------------------------------------

def test_readme_job_file_shows_every_key_with_its_default():
    block = README.read_text().split("## The job file", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    raw = yaml.safe_load(block)
    shown, defaults = parse_job(raw).to_dict(), job().to_dict()
    sections = ("input", "output", "sampling", "engine")
    assert set(raw) == set(defaults)
    assert {s: set(raw[s]) for s in sections} == {s: set(defaults[s]) for s in sections}
    differing = {f"{s}.{key}" for s in sections for key in defaults[s] if shown[s][key] != defaults[s][key]}
    assert differing == {"input.path", "input.id_column", "output.path"}  # the example's own values
