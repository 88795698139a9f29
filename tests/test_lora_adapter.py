"""Issue 42, its engine part: PEFT LoRA adapters read and checked against the base model before it loads (one
AdapterError naming the adapter and the key or tensor at fault), and applied per row in a batch: the base
projection once for every row, each adapter's low-rank product on its own rows. Through the engine (EngineArgs.lora,
Request.lora) rows of several adapters share steps and each equals transformers' model with its adapter merged
(fp32); the prefix cache never shares KV across adapters. The job file's keys are still to come."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from batchgen.lora import AdapterError, BaseShape, LoraContext, LoraLinear, read_adapter
from batchgen.lora import lora_linear
from batchgen.lora.adapter import ATTENTION_MODULES, MLP_MODULES
from batchgen.lora.random_adapter import write_adapter
from batchgen.models.inspector import describe_config

TARGETS = list(ATTENTION_MODULES + MLP_MODULES)


def base_shape(config) -> BaseShape:
    return BaseShape.of(describe_config(config))


@pytest.fixture(scope="module")
def tiny_config(tiny_llama_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_llama_dir)


def test_a_good_adapter_is_read_with_peft_scales(tmp_path, tiny_config):
    shape = base_shape(tiny_config)
    plain = read_adapter("plain", write_adapter(tmp_path / "plain", tiny_config, rank=8, alpha=16), shape)
    assert len(plain.modules) == tiny_config.num_hidden_layers * len(TARGETS) and plain.max_rank == 8
    assert {m.scale for m in plain.modules.values()} == {2.0}  # lora_alpha / r
    assert plain.nbytes() == sum(4 * (m.a.numel() + m.b.numel()) for m in plain.modules.values())
    rs = read_adapter("rs", write_adapter(tmp_path / "rs", tiny_config, rank=4, alpha=8, use_rslora=True), shape)
    assert {m.scale for m in rs.modules.values()} == {8 / 2}  # rsLoRA: lora_alpha / sqrt(r)
    patterned = write_adapter(tmp_path / "pattern", tiny_config, rank=4, alpha=8, layers=[0], targets=["q_proj"],
                              alpha_pattern={"q_proj": 32})
    [module] = read_adapter("pattern", patterned, shape).modules.values()
    assert (module.layer, module.module, module.scale) == (0, "q_proj", 8.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dense_max_rows", [512, 0], ids=["one-product-over-every-slot", "per-segment"])
def test_rows_of_different_adapters_in_one_call_equal_their_merged_weights(dtype, dense_max_rows, monkeypatch):
    """A packed q/k/v projection, rows of the base (slot 0) and of two adapters interleaved in segments: each row
    equals its own merged weight's product; an adapter that leaves k alone changes none of k's columns. Both ways
    of computing it (lora_linear.py), in fp32 and bf16."""
    monkeypatch.setattr(lora_linear, "DENSE_MAX_ROWS", dense_max_rows)
    torch.manual_seed(0)
    size_in, sizes = 32, [24, 8, 8]
    base = torch.nn.Linear(size_in, sum(sizes), bias=True).to(dtype)
    context = LoraContext()
    lora = LoraLinear(base, context, sizes, num_slots=3, rank=12, dtype=dtype)
    adapters = {1: [(torch.randn(4, size_in), torch.randn(s, 4), 2.0) for s in sizes],
                2: [(torch.randn(2, size_in), torch.randn(sizes[0], 2), 0.5), None,
                    (torch.randn(2, size_in), torch.randn(sizes[2], 2), 0.5)]}
    lora.load(3, adapters[1])  # then replaced: a slot's earlier adapter leaves nothing behind
    for slot, parts in adapters.items():
        lora.load(slot, parts)
    lora.load(3, [None, None, None])  # an adapter that leaves this projection alone
    x = torch.randn(11, size_in).to(dtype)
    context.set_segments([(0, 3, 1), (3, 5, 0), (5, 9, 2), (9, 10, 1), (10, 11, 3)])
    got = lora(x)
    for start, end, slot in context.segments:
        delta = torch.zeros(end - start, sum(sizes))
        first = 0
        for size, part in zip(sizes, adapters.get(slot, [None] * 3)):
            if part is not None:
                a, b, scale = part
                delta[:, first:first + size] = scale * (x[start:end].float() @ a.T) @ b.T
            first += size
        want = base(x[start:end]).float() + delta
        error = (got[start:end].float() - want).abs().max()
        # bf16: the low-rank product's rounding, a few of bf16's units (2^-8) of the largest value
        assert error <= (1e-5 if dtype == torch.float32 else 2 ** -5 * want.abs().max()), (slot, error)
    plain = base(x)
    assert torch.equal(got[5:9, 24:32], plain[5:9, 24:32])  # slot 2 leaves k's columns to the base
    assert torch.equal(got[10:11], plain[10:11])
    lora.unload(1)
    context.set_segments([(0, 11, 1)])
    assert torch.equal(lora(x), base(x))  # an unloaded slot: the base model


def corrupt(path: Path, how: str) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    weights = path / "adapter_model.safetensors"
    if how == "no config":
        (path / "adapter_config.json").unlink()
    elif how == "config not json":
        (path / "adapter_config.json").write_text("{r: 8")
    elif how == "cut short":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "not safetensors":
        weights.write_bytes(b"\xff" * 64)
    elif how == "no weights":
        weights.unlink()
    else:
        config.update(how)
        (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("how,key,message", [
    ("no config", "adapter_config.json", "has no adapter_config.json"),
    ("config not json", "adapter_config.json", "is not JSON"),
    ({"peft_type": "IA3"}, "peft_type", "peft_type is 'IA3'"),
    ({"r": 0}, "r", "r must be a positive number, got 0"),
    ({"use_dora": True}, "use_dora", "DoRA (use_dora: true) is not supported"),
    ({"bias": "all"}, "bias", "trained biases (bias: 'all') are not supported"),
    ({"modules_to_save": ["score"]}, "modules_to_save", "fully trained modules are not supported"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out", "fan_in_fan_out (Conv1D layers"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules", "target module lm_head is not supported"),
    ({"target_modules": ["q_proj", "c_attn"]}, "target_modules", "target module 'c_attn' is not one batchgen adapts"),
    ({"target_modules": ["q_proj"]}, "layers.0.k_proj", "has weights, but target_modules does not name k_proj"),
    ({"r": 16}, "layers.0.q_proj", "lora_A is [8, 64] and lora_B [64, 8]; the base model's q_proj takes 64 inputs"),
    ("cut short", "adapter_model.safetensors", "is cut short"),
    ("not safetensors", "adapter_model.safetensors", "is not a readable safetensors file"),
    ("no weights", "adapter_model.safetensors", "adapter_model.safetensors is missing"),
])
def test_a_broken_adapter_is_one_error_naming_it_and_the_key(tmp_path, tiny_config, how, key, message):
    path = write_adapter(tmp_path / "bad", tiny_config)
    corrupt(path, how)
    with pytest.raises(AdapterError) as caught:
        read_adapter("customer-7", path, base_shape(tiny_config))
    assert str(caught.value).startswith("lora adapter 'customer-7': ") and message in str(caught.value)
    assert caught.value.key == key and caught.value.adapter == "customer-7"


def test_an_adapter_of_another_base_model_is_refused_by_shape_and_layers(tmp_path, tiny_config):
    wider = type(tiny_config)(**{**tiny_config.to_dict(), "hidden_size": 128, "head_dim": 32})
    path = write_adapter(tmp_path / "wider", wider)
    with pytest.raises(AdapterError, match=r"an adapter of another base model\?"):
        read_adapter("wider", path, base_shape(tiny_config))
    deeper = type(tiny_config)(**{**tiny_config.to_dict(), "num_hidden_layers": 4})
    with pytest.raises(AdapterError, match="is for layer 2, but the base model has 2 layers"):
        read_adapter("deeper", write_adapter(tmp_path / "deeper", deeper), base_shape(tiny_config))
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64, dtype=torch.int32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8)}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="is I32; adapters must be F32, F16 or BF16"):
        read_adapter("ints", path, base_shape(tiny_config))


# -- the engine: rows of several adapters in one run ---------------------------------------------------------------

def merged_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens for `prompt` with the adapter merged into the weights (W + scale B A), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        adapter = read_adapter("merged", adapter_dir, base_shape(model.config))
        with torch.no_grad():
            for (layer, module), lora in adapter.modules.items():
                owner = model.model.layers[layer].mlp if module in MLP_MODULES else model.model.layers[layer].self_attn
                getattr(owner, module).weight += lora.scale * lora.b @ lora.a
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def adapters_for(root: Path, config) -> dict[str, str]:
    return {"first": str(write_adapter(root / "first", config, seed=1)),
            "second": str(write_adapter(root / "second", config, rank=4, alpha=8, seed=2, use_rslora=True,
                                        targets=["q_proj", "v_proj", "o_proj", "down_proj"]))}


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory, tiny_config) -> dict[str, str]:
    return adapters_for(tmp_path_factory.mktemp("adapters"), tiny_config)


@pytest.mark.parametrize("base", ["tiny_llama_dir", "tiny_gemma3_dir"])
def test_rows_alternating_base_and_two_adapters_in_one_run_equal_the_merged_models(tmp_path, request, base):
    """Every row's greedy tokens equal transformers' with its adapter merged (none for a base row), rows of the
    three in the same steps (fp32): Llama, and Gemma 3 (sliding-window layers, (1 + w) norms, GELU MLP)."""
    from transformers import AutoConfig

    from batchgen.engine import Engine, EngineArgs, Request, SamplingParams

    model_dir = request.getfixturevalue(base)
    two_adapters = adapters_for(tmp_path, AutoConfig.from_pretrained(model_dir))
    engine = Engine(EngineArgs(model=str(model_dir), dtype="float32", lora=two_adapters,
                               kv_cache_memory="64MiB"))
    prompts = [[5, 17, 99, 3, 250, 7], [8, 1, 64, 33, 2], [300, 12, 9, 9, 41, 5, 77], [5, 17, 99, 3, 250, 7, 1],
               [44, 45, 46], [200, 100, 50, 25, 12, 6]]
    names = [None, "first", "second"] * 2
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = {r.request_id: r for r in engine.generate(
        Request(i, prompt, params, lora=name) for i, (prompt, name) in enumerate(zip(prompts, names)))}
    assert engine.num_steps < len(prompts) * 8  # the rows shared steps
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        want = merged_greedy(model_dir, None if name is None else Path(two_adapters[name]), prompt, 8)
        assert results[i].token_ids == want, (i, name)
    base = [merged_greedy(model_dir, None, prompt, 8) for prompt in prompts[1:3]]
    assert [results[1].token_ids, results[2].token_ids] != base  # the adapters change the outputs


def test_more_adapters_than_max_loras_are_read_on_demand_and_give_the_same_tokens(tmp_path, tiny_llama_dir,
                                                                                   tiny_config):
    """Three adapters, rows of all three and the base interleaved: with max_loras 1 and 2 the adapters take turns in
    the model's slots (read again from their directories, least recently used out first), never more in one step
    than there are slots, and every row's tokens equal those of a run with all three resident."""
    from batchgen.engine import Engine, EngineArgs, Request, SamplingParams

    adapters = {**adapters_for(tmp_path, tiny_config),
                "third": str(write_adapter(tmp_path / "third", tiny_config, rank=16, alpha=8, seed=3))}
    names = [None, "first", "second", "third"] * 3
    prompts = [[5 + i, 17, 99, 3 + i, 250, 7][: 3 + i % 4] for i in range(len(names))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(max_loras):
        engine = Engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", lora=adapters, max_loras=max_loras,
                                   kv_cache_memory="64MiB"))
        seen = []
        assign = engine.adapters.assign
        engine.adapters.assign = lambda step: seen.append(set(step)) or assign(step)
        results = {}
        for round in range(2):  # the second round needs again the adapters the first one ended without
            results.update({(round, r.request_id): r.token_ids for r in engine.generate(
                Request(i, prompt, params, lora=name) for i, (prompt, name) in enumerate(zip(prompts, names)))})
        assert max(len(step) for step in seen) <= max_loras and len(engine.adapters.resident) == max_loras
        return results, engine.adapters.num_loads

    everything, loads = run(3)
    assert loads == 3
    for max_loras in (1, 2):
        results, loads = run(max_loras)
        assert results == everything, max_loras
        assert loads > 3, max_loras  # adapters went out of their slots and came back


def test_the_prefix_cache_never_shares_kv_across_adapters(tiny_llama_dir, two_adapters):
    from batchgen.engine import Engine, EngineArgs, Request, SamplingParams

    engine = Engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", lora=two_adapters, block_size=4,
                               kv_cache_memory="64MiB"))
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def run(request_id, name):
        [result] = engine.generate([Request(request_id, prompt, params, lora=name)])
        return result.cached_tokens

    assert run("first", "first") == 0
    assert run("second", "second") == 0  # the same prompt under another adapter: computed again
    assert run("base", None) == 0
    assert run("first again", "first") == 16  # under the same adapter: its full blocks from the cache
    [unknown] = engine.generate([Request("x", prompt, params, lora="third")])
    assert unknown.finish_reason == "error" and unknown.error == "lora adapter 'third' is not loaded (loaded: first, " \
                                                                 "second)"


def test_an_adapter_that_does_not_fit_is_refused_before_the_model_loads(tmp_path, tiny_llama_dir, tiny_config):
    from batchgen.engine import Engine, EngineArgs, SettingError

    wider = type(tiny_config)(**{**tiny_config.to_dict(), "hidden_size": 128, "head_dim": 32})
    with pytest.raises(SettingError) as caught:
        Engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                          lora={"wide": str(write_adapter(tmp_path / "wide", wider))}))
    assert caught.value.key == "lora"
    assert "lora adapter 'wide': layers.0.q_proj: lora_A is [8, 128]" in str(caught.value)
    with pytest.raises(SettingError) as caught:
        Engine(EngineArgs(model=str(tiny_llama_dir), lora={"a": str(tmp_path / "nowhere")}))
    assert caught.value.key == "lora" and "lora adapter 'a'" in str(caught.value)
