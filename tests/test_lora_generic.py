"""LoRA adapters on the generic path (transformers' own modeling code on batchgen's engine): each layer's q/k/v/o and
gate/up/down nn.Linear wrapped as the native path's packed projections are. Rows of the base and of two adapters in
one run equal transformers' greedy output with that adapter merged (fp32): Llama forced onto the generic path, and
OLMo 2 (q/k norms), which has no native implementation. A model whose projections are fused (Phi-3's qkv_proj) is
refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams, SettingError
from batchgen.lora.random_adapter import write_adapter
from test_generic_models import tiny_model
from test_lora_adapter import merged_greedy

PROMPTS = [[5, 17, 99, 3, 250, 7], [8, 1, 64, 33, 2], [300, 12, 9, 9, 41, 5, 77], [44, 45, 46], [200, 100, 50, 25]]
NAMES = [None, "first", "second", "first", None]


@pytest.mark.parametrize("architecture", ["llama-as-generic", "olmo2"])
def test_rows_of_two_adapters_on_the_generic_path_equal_the_merged_models(tmp_path, tiny_llama_dir, architecture):
    model_dir = tiny_llama_dir if architecture == "llama-as-generic" else tiny_model("olmo2", tmp_path / "olmo2")
    config = AutoConfig.from_pretrained(model_dir)
    adapters = {"first": str(write_adapter(tmp_path / "first", config, seed=1)),
                "second": str(write_adapter(tmp_path / "second", config, rank=4, alpha=8, seed=2,
                                            targets=["q_proj", "v_proj", "o_proj", "down_proj"]))}
    wants = [merged_greedy(model_dir, None if name is None else Path(adapters[name]), prompt, 8)
             for prompt, name in zip(PROMPTS, NAMES)]
    base = merged_greedy(model_dir, None, PROMPTS[1], 8)
    engine = Engine(EngineArgs(model=str(model_dir), dtype="float32", lora=adapters, model_impl="transformers",
                               kv_cache_memory="64MiB"))
    assert engine.plan.model.path == "generic"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = {r.request_id: r.token_ids for r in engine.generate(
        Request(i, prompt, params, lora=name) for i, (prompt, name) in enumerate(zip(PROMPTS, NAMES)))}
    assert [results[i] for i in range(len(PROMPTS))] == wants, architecture
    assert results[1] != base  # the adapter changed the output


def test_fused_projections_are_refused_by_name(tmp_path):
    model_dir = tiny_model("phi3", tmp_path / "phi3")
    config = AutoConfig.from_pretrained(model_dir)
    adapter = write_adapter(tmp_path / "adapter", config, targets=["q_proj", "o_proj"])
    with pytest.raises(SettingError) as caught:
        Engine(EngineArgs(model=str(model_dir), dtype="float32", lora={"a": str(adapter)},
                          kv_cache_memory="16MiB"))
    assert caught.value.key == "lora"
    assert "targets q_proj of layer 0, which this model does not have as such" in str(caught.value)
