"""The generic model path (models/generic*.py): decoders batchgen has no implementation of run as transformers' own
code on batchgen's engine. Tiny random models of every architecture listed, built here: greedy output equals
transformers' (fp32) through the engine's request API, under chunked prefill and mixed decode/prefill steps; through
`batchgen run` for a few; the others refused by name before any weight is read."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen.bench.greedy_check import assert_greedy_matches, hf_greedy
from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.models.generic import TransformersCausalLM
from batchgen.models.loader import load_model
from batchgen.models.registry import UnsupportedModelError
from conftest import save_tiny_model

REPO = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)
WINDOW = 8  # shorter than the prompts: sliding-window layers attend over less than the whole context
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=1)
# model_type -> the config's settings beyond TINY (what makes the architecture's own feature bite at this size)
ARCHITECTURES = {
    "phi3": {}, "phi": {}, "granite": {}, "olmo": {}, "olmo2": {}, "olmo3": {"sliding_window": WINDOW},
    "smollm3": {}, "starcoder2": {"sliding_window": WINDOW}, "glm": {}, "glm4": {}, "gemma": {},
    "gemma2": {"sliding_window": WINDOW},  # every other layer local, attention and final logits softcapped
    "cohere": {}, "cohere2": {"sliding_window": WINDOW}, "gpt_neox": {}, "gptj": {"rotary_dim": 8}, "gpt2": {},
    "opt": {}, "persimmon": {}, "nemotron": {}, "exaone4": {}, "helium": {}, "arcee": {}, "apertus": {},
    "seed_oss": {}, "ernie4_5": {}, "hunyuan_v1_dense": {"rope_theta": 10000.0},
    "deepseek_v2": _MLA, "deepseek_v3": {**_MLA, "head_dim": 8, "n_group": 2, "topk_group": 1},  # MLA + MoE
    "gpt_oss": {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},  # sinks, windows, MoE
    "qwen2_moe": {}, "qwen3_moe": {}, "olmoe": {}, "granitemoe": {}, "phimoe": {}, "mixtral": {},
}
# model_type -> (its settings beyond TINY, what the refusal names)
REFUSED = {
    "mamba": ({}, "'linear_attention' layers"), "jamba": ({}, "hybrid model"),
    "qwen3_next": ({}, "'linear_attention' layers"), "falcon_h1": ({}, "hybrid"), "minimax": ({}, "linear_attention"),
    "lfm2": ({"layer_types": ["conv", "full_attention"]}, "'conv' layers"), "bloom": ({}, "ALiBi"),
    "mpt": ({}, "ALiBi"), "stablelm": ({}, "attention interface"),
}
MAX_TOKENS = 12


def tiny_model(model_type: str, path: Path, extra: dict | None = None, **overrides) -> Path:
    settings = {**TINY, **(ARCHITECTURES.get(model_type) or {}), **(extra or {}), **overrides}
    return save_tiny_model(AutoConfig.for_model(model_type, **settings), path)


def prompts(seed: int = 0, n: int = 6, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def hf_references(model_dir: Path, token_lists: list[list[int]]) -> tuple[torch.nn.Module, list[list[int]]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf, [hf_greedy(hf, ids, MAX_TOKENS) for ids in token_lists]


def engine_outputs(model_dir: Path, token_lists: list[list[int]], **args) -> list[list[int]]:
    """Greedy through the engine's request API (stopping at the model's EOS, as transformers' generate), with small
    steps: prompts prefilled in chunks beside decodes."""
    settings = dict(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=32,
                    max_num_seqs=4)
    engine = Engine(EngineArgs(**{**settings, **args}))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = {r.request_id: r for r in engine.generate(Request(i, ids, params) for i, ids in enumerate(token_lists))}
    assert not [r.error for r in results.values() if r.error]
    return [results[i].token_ids for i in range(len(token_lists))]


FAST = ("phi3", "gemma2", "deepseek_v3")  # one of each kind in the edit-test loop: dense, windows+softcap, MLA+MoE


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=() if t in FAST else pytest.mark.slow)
                                        for t in ARCHITECTURES])
def test_greedy_equals_transformers(model_type, tmp_path):
    model_dir = tiny_model(model_type, tmp_path / model_type)
    token_lists = prompts()
    hf, references = hf_references(model_dir, token_lists)
    outputs = engine_outputs(model_dir, token_lists)
    assert_greedy_matches(hf, token_lists, references, outputs)


def test_a_native_architecture_on_the_generic_path(tiny_llama_dir):
    """model_impl transformers runs a Llama through transformers' code; auto runs it natively; both equal HF."""
    token_lists = prompts(1, vocab=384)
    hf, references = hf_references(tiny_llama_dir, token_lists)
    assert type(load_model(tiny_llama_dir, torch.float32, "cpu", model_impl="transformers")) is TransformersCausalLM
    assert type(load_model(tiny_llama_dir, torch.float32, "cpu")) is not TransformersCausalLM
    for impl in ("transformers", "auto"):
        assert_greedy_matches(hf, token_lists, references, engine_outputs(tiny_llama_dir, token_lists,
                                                                          model_impl=impl))


def test_model_impl_native_refuses_an_architecture_without_one(tmp_path):
    model_dir = tiny_model("phi3", tmp_path / "phi3")
    with pytest.raises(UnsupportedModelError, match="Phi3ForCausalLM.*supported natively: LlamaForCausalLM"):
        load_model(model_dir, torch.float32, "cpu", model_impl="native")


@pytest.mark.slow
def test_bfloat16_with_packed_linear_layers(tmp_path):
    """The CPU's bf16 path (oneDNN-packed or fp32-computed linear layers) on a generic model: tokens close to fp32's
    (bf16 rounding moves near-ties; most prompts' first tokens stay)."""
    model_dir = tiny_model("phi3", tmp_path / "phi3")
    token_lists = prompts(2)
    fp32 = engine_outputs(model_dir, token_lists)
    bf16 = engine_outputs(model_dir, token_lists, dtype="bfloat16")
    assert sum(a[:3] == b[:3] for a, b in zip(fp32, bf16)) >= len(token_lists) // 2


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_refused_by_name_before_any_weight(model_type, tmp_path):
    """config.json and a weights file that is not one: the refusal is about the architecture, never the weights."""
    settings, named = REFUSED[model_type]
    model_dir = tmp_path / model_type
    config = AutoConfig.for_model(model_type, **{**TINY, **settings})
    config.architectures = [config.architectures[0] if config.architectures else _causal_lm_name(model_type)]
    config.save_pretrained(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UnsupportedModelError) as error:
        load_model(model_dir, torch.float32, "cpu")
    assert f"unsupported model architecture '{config.architectures[0]}'" in str(error.value)
    assert named in str(error.value)


def _causal_lm_name(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


# --- through `batchgen run`: text in, text out, with the default model's tokenizer ------------------------------

TEXTS = ["The capital of France is", "List three colors:", "def fibonacci(n):", "Water boils at",
         "Once upon a time, in a small village by the sea, there lived an old fisherman who"]


CLI_ARCHITECTURES = ("phi3", "gemma2", "gpt_oss", "deepseek_v3", "granitemoe", "gpt2")  # none native


@pytest.fixture(scope="module")
def cli_models(tmp_path_factory, default_model_dir):
    """model_type -> a tiny model with the default model's tokenizer (its 49,152-token vocabulary), built once."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    built = {}

    def build(model_type: str) -> Path:
        if model_type not in built:
            path = tmp_path_factory.mktemp(model_type)
            tiny_model(model_type, path, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id or 0,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
            tokenizer.save_pretrained(path)
            built[model_type] = path
        return built[model_type]

    return build


def write_job(tmp_path: Path, model_dir: Path, **engine) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "prompt": TEXTS}), tmp_path / "in.parquet")
    job = {"model": str(model_dir), "dtype": "float32",
           "input": {"path": str(tmp_path / "in.parquet"), "id_column": "id", "prompt_column": "prompt",
                     "chat_template": False},
           "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
           "engine": {"max_num_seqs": 2, "max_num_batched_tokens": 16, "kv_cache_memory": "32MiB", **engine},
           "output": {"path": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    return tmp_path / "job.yaml"


def test_plan_names_the_path(cli_models, tmp_path):
    from batchgen.job import load_job
    from batchgen.job.plan.estimate import make_plan
    from batchgen.job.plan.report import format_plan

    def path_line(model_dir, **engine) -> str:
        plan = make_plan(load_job(write_job(tmp_path, model_dir, **engine)), archive=tmp_path / "none.jsonl")
        return next(line.strip() for line in format_plan(plan, "job.yaml").splitlines() if "path: " in line)

    assert path_line(cli_models("phi3")).startswith("path: generic (no native one): transformers' Phi3ForCausalLM")
    assert path_line(cli_models("phi3"), model_impl="transformers").startswith("path: generic (no native one)")
    assert path_line(cli_models("llama")) == ("path: native: batchgen's own LlamaForCausalLM (fused kernels, packed "
                                         "linear layers)")
    assert path_line(cli_models("llama"), model_impl="transformers").startswith(
        "path: generic (model_impl: transformers): transformers' LlamaForCausalLM code")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", CLI_ARCHITECTURES)
def test_batchgen_run_texts_equal_transformers(model_type, cli_models, tmp_path):
    import polars as pl
    from transformers import AutoTokenizer

    model_dir = cli_models(model_type)
    job = write_job(tmp_path, model_dir)
    ran = subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert summary["engine_stats"]["model_path"] == "generic"
    assert summary["peak_memory_bytes"] <= summary["memory_bound_bytes"]
    texts = pl.read_parquet(str(tmp_path / "out" / "*.parquet")).sort("id")["text"].to_list()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf, references = hf_references(model_dir, [tokenizer(text)["input_ids"] for text in TEXTS])
    ends = {tokenizer.eos_token_id}  # the text of a row that stopped holds no EOS
    assert texts == [tokenizer.decode(ref[:-1] if ref and ref[-1] in ends else ref) for ref in references]
