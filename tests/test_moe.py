"""The sparse mixture-of-experts decoders (models/moe.py, moe_models.py) against transformers' own, on tiny random
checkpoints that transformers writes itself (save_pretrained: one tensor per expert and projection, Mixtral's named
block_sparse_moe...w1/w2/w3): logits over a paged cache, greedy output through the engine's API and through
`batchgen run`, the settings that make them match, and the `_SUCCESS` memory bound with every expert resident."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from batchgen.bench.greedy_check import assert_greedy_matches, hf_greedy
from batchgen.cli import main
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.models import build_model
from batchgen.models.inspector import checkpoint_sources, describe_model
from batchgen.models.loader import load_model
from batchgen.models.moe import SparseMoeBlock
import test_batch_invariance as invariance
from conftest import save_tiny_model
from test_models import PagedSequences, assert_close, random_tokens, reference_logits
from test_memory_bound import bounded_run
from test_plan import write_input

MAX_TOKENS = 10
VOCAB = 49152  # the default model's tokenizer, borrowed so that `batchgen run` can tokenize text
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
# Each architecture's tiny config, with the settings that choose its sparse layers and routing set away from the
# defaults where that tells more: Qwen3-MoE with a dense layer in the middle (mlp_only_layers) and renormalised
# top-k; Qwen2-MoE sparse every second layer, with its shared expert; OLMoE with a clamp that bites.
ARCHITECTURES = {
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      head_dim=16, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=48, decoder_sparse_step=2),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=3, clip_qkv=1.0),
}
SPARSE_LAYERS = {"qwen3_moe": [0, 2], "qwen2_moe": [1], "mixtral": [0, 1, 2], "olmoe": [0, 1, 2]}


def copy_tokenizer(source: Path, target: Path) -> None:
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, target / file.name)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, default_model_dir):
    """model_type → its tiny model's directory (transformers' save_pretrained, the default tokenizer), built once."""
    built: dict[str, Path] = {}

    def build(model_type: str) -> Path:
        if model_type not in built:
            config = AutoConfig.for_model(model_type, **_SMALL, **ARCHITECTURES[model_type])
            seed = list(ARCHITECTURES).index(model_type)
            path = save_tiny_model(config, tmp_path_factory.mktemp(model_type), seed=seed)
            copy_tokenizer(default_model_dir, path)
            built[model_type] = path
        return built[model_type]

    return build


@pytest.fixture(scope="module")
def hf_model():
    loaded: dict[Path, torch.nn.Module] = {}

    def load(path: Path):
        if path not in loaded:
            loaded[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return loaded[path]

    return load


def checkpoint_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as shard:
        return set(shard.keys())


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_we_read_what_transformers_saves(moe_dir, model_type):
    path = moe_dir(model_type)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = build_model(config)
    sources = checkpoint_sources(model)
    assert {name for names in sources.values() for name in names} == checkpoint_names(path)
    gate, up, down = ([f"block_sparse_moe.experts.7.{w}" for w in ("w1", "w3", "w2")] if model_type == "mixtral"
                      else [f"mlp.experts.7.{p}_proj" for p in ("gate", "up", "down")])
    layer = SPARSE_LAYERS[model_type][-1]
    assert sources[f"model.layers.{layer}.mlp.experts.7.gate_up_proj.weight"] == [
        f"model.layers.{layer}.{gate}.weight", f"model.layers.{layer}.{up}.weight"]
    assert sources[f"model.layers.{layer}.mlp.experts.7.down_proj.weight"] == [f"model.layers.{layer}.{down}.weight"]
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == SPARSE_LAYERS[model_type]
    description = describe_model(path)
    assert description.num_experts == 8 and description.architecture == config.architectures[0]
    assert description.parameters == sum(t.numel() for t in AutoModelForCausalLM.from_config(config).parameters())


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_logits_match_transformers_over_a_paged_cache(moe_dir, hf_model, model_type):
    """Prefill of three sequences in one flat batch, then decode steps with a prefill joining them."""
    path = moe_dir(model_type)
    hf = hf_model(path)
    model = load_model(path, torch.float32, "cpu", pack=True)
    prompts = {"a": random_tokens(5, 1, VOCAB), "b": random_tokens(11, 2, VOCAB), "c": random_tokens(17, 3, VOCAB)}
    cache = PagedSequences(model)
    logits = cache.step(prompts)
    assert_close(logits, torch.cat([reference_logits(hf, p) for p in prompts.values()]))
    ends = {"a": 4, "b": 15, "c": 32}
    next_tokens = {seq: [int(logits[end].argmax())] for seq, end in ends.items()}
    late = random_tokens(9, 4, VOCAB)
    for step in range(3):
        logits = cache.step({**next_tokens, **({"late": late} if step == 1 else {})})
        for row, seq in enumerate(next_tokens):
            assert_close(logits[row], reference_logits(hf, cache.tokens[seq])[-1])
            next_tokens[seq] = [int(logits[row].argmax())]
        if step == 1:
            assert_close(logits[3:], reference_logits(hf, late))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe", "mixtral"])
def test_the_routing_settings_are_what_make_it_match(moe_dir, hf_model, model_type, tmp_path):
    """With the setting flipped in config.json, our logits move away from transformers' (so the equality above
    tests them): Qwen3-MoE's norm_topk_prob, OLMoE's clip_qkv; Mixtral's 2 of 8 experts against 3."""
    path = tmp_path / model_type
    shutil.copytree(moe_dir(model_type), path)
    config = json.loads((path / "config.json").read_text())
    flipped = {"qwen3_moe": {"norm_topk_prob": False}, "olmoe": {"clip_qkv": None},
               "mixtral": {"num_experts_per_tok": 3}}[model_type]
    (path / "config.json").write_text(json.dumps({**config, **flipped}))
    prompt = random_tokens(17, 3, VOCAB)
    logits = PagedSequences(load_model(path, torch.float32, "cpu")).step({"p": prompt})
    assert (logits - reference_logits(hf_model(moe_dir(model_type)), prompt)).abs().max() > 1e-2


def greedy_prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 4, 9, 16, 33)]
    return prompts + [shared + [rng.randrange(VOCAB) for _ in range(n)] for n in (2, 7)]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16}], ids=["batched", "chunked"])
def test_engine_greedy_matches_transformers(moe_dir, hf_model, model_type, settings):
    path = moe_dir(model_type)
    hf = hf_model(path)
    prompts = greedy_prompts()
    engine = Engine(EngineArgs(model=str(path), dtype="float32", kv_cache_memory="32MiB", max_num_seqs=16,
                               **settings))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = {r.request_id: r for r in engine.generate(Request(i, p, params) for i, p in enumerate(prompts))}
    outputs = [results[i].token_ids for i in range(len(prompts))]
    assert_greedy_matches(hf, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts], outputs)
    assert engine.stats()["prefix_cache_hits"] > 0  # the shared prefix came from the cache


TEXTS = ["The sea is", "Count to three:", "A recipe for bread", "Why is the sky blue?", "Rome was",
         "Write a haiku about rain."]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_batchgen_run_matches_transformers(moe_dir, hf_model, model_type, tmp_path):
    path = moe_dir(model_type)
    job = {"model": str(path), "dtype": "float32",
           "input": {"path": str(write_input(tmp_path / "in.parquet", TEXTS)), "id_column": "id",
                     "chat_template": False},
           "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 1},
           "engine": {"kv_cache_memory": "32MiB"}, "output": {"path": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--quiet"])
    assert result.exit_code == 0, result.output
    rows = pl.read_parquet(tmp_path / "out" / "*.parquet").sort("id").iter_rows(named=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    outputs = [[step[0]["token_id"] for step in row["top_logprobs"]] for row in rows]
    hf = hf_model(path)
    assert_greedy_matches(hf, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts], outputs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariance_holds_with_experts(tmp_path, dtype):
    """engine.batch_invariant: a row's tokens and logprobs are bit-identical whatever runs beside it, though the
    rows each expert multiplies at once depend on the whole batch (test_batch_invariance.py's prompts and ways)."""
    config = AutoConfig.for_model("qwen3_moe", **{**_SMALL, "vocab_size": invariance.VOCAB, "hidden_size": 256,
                                                  "num_hidden_layers": 2, "head_dim": 64},
                                  intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                                  num_experts_per_tok=2, norm_topk_prob=True)
    invariance.check_invariance(save_tiny_model(config, tmp_path, seed=6), dtype, None, "1536KiB")


@pytest.mark.slow
def test_peak_memory_of_a_moe_run_is_within_the_printed_bound(tmp_path, default_model_dir):
    """Every expert is resident: a Qwen3-MoE of 156 M parameters (16 experts of 512 in each of 8 layers: 101 M of
    them experts') in fp32 through `batchgen run` in its own process, as tests/test_memory_bound.py runs a dense
    model."""
    config = AutoConfig.for_model("qwen3_moe", **{**_SMALL, "hidden_size": 512, "num_hidden_layers": 8,
                                                  "num_attention_heads": 8, "head_dim": 64},
                                  intermediate_size=1024, moe_intermediate_size=512, num_experts=16,
                                  num_experts_per_tok=2, torch_dtype="float32")
    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    copy_tokenizer(default_model_dir, model_dir)
    peak, bound, weights = bounded_run(model_dir, tmp_path, TEXTS, 4, {})
    assert weights > 580 * 2**20  # every expert's weights are held
    print(f"peak {peak / 2**20:,.0f} MiB, bound {bound / 2**20:,.0f} MiB, weights {weights / 2**20:,.0f} MiB")
    assert peak <= bound, f"peak {peak / 2**20:,.0f} MiB over the bound {bound / 2**20:,.0f} MiB"
