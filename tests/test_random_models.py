"""dev/make_random_model.py: tiny variants of every shape load in transformers with exactly the checkpoint's
tensors, in batchgen (Llama, Qwen), sharded the same as whole; the full shapes' configs are the real ones; a
directory inside a git checkout is refused."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from batchgen.models.loader import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("make_random_model", ROOT / "dev" / "make_random_model.py")
mrm = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = mrm  # for its dataclasses
_SPEC.loader.exec_module(mrm)


def make_tiny(shape: str, out: Path, tokenizer_dir: Path, **options):
    """The shape with 2 layers and a hidden size of about 64 (a multiple of its real head count, which stays)."""
    heads = mrm.SHAPES[shape]["num_attention_heads"]
    tiny = mrm.Overrides(layers=2, hidden=-(-64 // heads) * heads, intermediate=128)
    return mrm.make_random_model(shape, out, tokenizer_dir=tokenizer_dir, overrides=tiny, **options)


BATCHGEN_SHAPES = list(mrm.SHAPES)  # every shape loads in batchgen too


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    """shape → its tiny model's directory, built once per module."""
    built: dict[str, Path] = {}

    def build(shape: str) -> Path:
        if shape not in built:
            out = tmp_path_factory.mktemp(shape)
            make_tiny(shape, out, default_model_dir)
            built[shape] = out
        return built[shape]

    return build


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                assert name not in tensors, f"{name} in two shards"
                tensors[name] = shard.get_tensor(name)
    return tensors


@pytest.mark.parametrize("shape", list(mrm.SHAPES))
def test_transformers_loads_every_shape(tiny, shape):
    model_dir = tiny(shape)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == mrm.SHAPES[shape]["architectures"]
    assert (config["torch_dtype"], config["vocab_size"], config["num_hidden_layers"]) == ("bfloat16", 49152, 2)
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0]
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[1, 20, 300, 4000]])).logits
    assert logits.shape == (1, 4, 49152) and torch.isfinite(logits).all()
    tensors = read_tensors(model_dir)
    assert ("lm_head.weight" in tensors) == (not config["tie_word_embeddings"])
    neutral = 0.0 if shape.startswith("gemma") else 1.0  # Gemma's RMSNorm scales by (1 + w)
    assert all(torch.all(t == neutral) for name, t in tensors.items() if name.endswith("norm.weight"))
    assert abs(tensors["model.embed_tokens.weight"].float().std().item() - 0.02) < 1e-3


@pytest.mark.parametrize("shape", BATCHGEN_SHAPES)
def test_batchgen_loads_llama_and_qwen(tiny, shape):
    model_dir = tiny(shape)
    model = load_model(model_dir, torch.float32, "cpu")
    real = mrm.SHAPES[shape]
    assert (model.num_layers, model.num_kv_heads, model.vocab_size) == (2, real["num_key_value_heads"], 49152)
    assert model.head_dim == real.get("head_dim", real["hidden_size"] // real["num_attention_heads"])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == real["tie_word_embeddings"]
    tensors = read_tensors(model_dir)
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"].float())
    if shape.startswith("qwen"):
        qkv = model.get_submodule("model.layers.1.self_attn.qkv_proj")
        assert torch.equal(qkv.bias, torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.bias"].float()
                                                for p in "qkv"]))


def test_sharded_write_has_a_complete_index_and_loads_identically(tiny, tmp_path, default_model_dir):
    whole_dir = tiny("llama-8b")
    sharded_dir = tmp_path / "sharded"
    make_tiny("llama-8b", sharded_dir, default_model_dir, max_shard_bytes=200_000)
    index = json.loads((sharded_dir / mrm.INDEX_FILE).read_text())
    files = sorted(sharded_dir.glob("*.safetensors"))
    assert len(files) > 3 and set(index["weight_map"].values()) == {file.name for file in files}
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            assert sorted(shard.keys()) == sorted(n for n, f in index["weight_map"].items() if f == file.name)
    whole, sharded = read_tensors(whole_dir), read_tensors(sharded_dir)  # read_tensors: each tensor once
    assert sharded.keys() == whole.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sharded.values())
    assert all(torch.equal(whole[name], sharded[name]) for name in whole)
    whole_model = load_model(whole_dir, torch.float32, "cpu").state_dict()
    sharded_model = load_model(sharded_dir, torch.float32, "cpu").state_dict()
    assert all(torch.equal(whole_model[name], sharded_model[name]) for name in whole_model)


def test_seed_changes_the_weights(tiny, tmp_path, default_model_dir):
    make_tiny("qwen2.5-1.5b", tmp_path, default_model_dir, seed=1)
    first, other = read_tensors(tiny("qwen2.5-1.5b")), read_tensors(tmp_path)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])


def test_full_shapes_are_the_real_configs(default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    llama = mrm.hf_config(mrm.model_config("llama-8b", tokenizer))
    assert (llama.hidden_size, llama.num_hidden_layers, llama.intermediate_size, llama.tie_word_embeddings) == (
        4096, 32, 14336, False)
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 8.0
    assert llama.rope_parameters["rope_theta"] == 500000.0
    gemma = mrm.hf_config(mrm.model_config("gemma3-1b", tokenizer))
    assert gemma.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (gemma.sliding_window, gemma.head_dim, gemma.query_pre_attn_scalar) == (512, 256, 256)
    assert gemma.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert gemma.rope_parameters["full_attention"]["rope_theta"] == 1000000.0


def test_dry_run_counts_the_issues_1_07_b_for_llama_1b(capsys, default_model_dir, tmp_path):
    assert mrm.main(["--shape", "llama-1b", "--dry-run", "--tokenizer", str(default_model_dir),
                     "--out", str(tmp_path / "m")]) == 0
    assert "llama-1b: 1.07 B parameters (1,073,809,408)" in capsys.readouterr().out
    assert not (tmp_path / "m").exists()


def test_output_inside_a_git_checkout_is_refused(tmp_path, default_model_dir, capsys):
    with pytest.raises(mrm.RandomModelError, match="inside the git checkout"):
        make_tiny("llama-1b", ROOT / "random-model", default_model_dir)
    assert not (ROOT / "random-model").exists()
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    assert mrm.main(["--shape", "llama-1b", "--out", str(tmp_path / "repo" / "sub" / "m")]) == 2
    assert "weights must never land in git" in capsys.readouterr().err


def test_existing_model_is_replaced_only_with_force(tiny, default_model_dir):
    model_dir = tiny("llama-1b")
    with pytest.raises(mrm.RandomModelError, match="--force"):
        make_tiny("llama-1b", model_dir, default_model_dir)
    before = read_tensors(model_dir)
    make_tiny("llama-1b", model_dir, default_model_dir, force=True)
    after = read_tensors(model_dir)
    assert after.keys() == before.keys() and all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("model_type", ["phi3", "olmo2"])
def test_any_transformers_architecture(model_type, tmp_path, default_model_dir):
    """--shape takes any transformers model_type with a causal LM: its default config, cut down; transformers
    and batchgen (the generic path) load what it writes."""
    out = tmp_path / model_type
    mrm.make_random_model(model_type, out, tokenizer_dir=default_model_dir, dtype="float32",
                          overrides=mrm.Overrides(layers=2, hidden=64, intermediate=128, head_dim=16))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and config["num_hidden_layers"] == 2
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    assert type(load_model(out, torch.float32, "cpu")).__name__ == "TransformersCausalLM"
