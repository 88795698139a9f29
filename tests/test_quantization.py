"""quantization: int8 — the Int8Linear kernel paths against a dequantized reference, quantize_model on tiny random
models, the engine and the job file with it, and the plan's weight bytes."""
import pytest
import torch
from torch import nn

from batchgen.engine import Engine, EngineArgs, Request, SamplingParams
from batchgen.engine.errors import SettingError
from batchgen.models.loader import load_model
from batchgen.models.accounting import weight_bytes
from batchgen.models.quantization import (Int8Linear, is_quantized, quantize_model, quantize_weight,
                                          stored_int8_quantization)


def test_quantize_weight_is_per_channel_symmetric_and_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 40) * torch.linspace(0.01, 3.0, 48)[:, None]  # channels of very different ranges
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (48,) and q.abs().max() <= 127
    assert torch.equal(q.abs().amax(dim=1), torch.full((48,), 127, dtype=torch.int8))  # each row uses its range
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("activations,dtype", [("dynamic_int8", torch.float32), ("dynamic_int8", torch.bfloat16),
                                               ("weight_only", torch.bfloat16)])
def test_int8_linear_matches_the_dequantized_reference(activations, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=True).to(dtype)
    layer = Int8Linear.from_linear(linear, activations)
    x = torch.randn(3, 7, 96).to(dtype)  # any leading shape
    out = layer(x)
    assert out.dtype == dtype and out.shape == (3, 7, 80)
    reference = x.float() @ layer.dequantized().T + linear.bias.float()
    tolerance = {torch.float32: 0.02, torch.bfloat16: 0.04}[dtype]  # dynamic int8 activations: ~0.4% per element
    assert (out.float() - reference).abs().max() <= tolerance * reference.abs().max()
    # and the dequantized weight is the layer's own, close to the original
    assert (layer.dequantized() - linear.weight.float()).abs().max() <= layer.scale.float().max() / 2 + 1e-3


def test_stored_int8_weights_are_used_as_stored_and_their_activations_follow_the_dtype():
    """A converted GGUF's int8 (models/gguf_int8.py): the layer multiplies by the stored q * scale, its scales in
    the activations' dtype for weight-only; W8A8 where the activations are fp32, weight-only where 16-bit, unless
    the job's quantization says which."""
    assert stored_int8_quantization(None, torch.float32) == "int8"
    assert stored_int8_quantization(None, torch.bfloat16) == stored_int8_quantization(None, torch.float16) == \
        "int8-weight-only"
    assert stored_int8_quantization("int8", torch.bfloat16) == "int8"
    torch.manual_seed(0)
    q, scale = quantize_weight(torch.randn(32, 64), torch.bfloat16)  # the conversion's bf16-exact scales
    layer = Int8Linear.from_int8(q, scale.float(), None, "weight_only", torch.bfloat16)
    assert layer.qweight is q and layer.scale.dtype == torch.bfloat16 and torch.equal(layer.scale, scale)
    assert Int8Linear.from_int8(q, scale.float(), None, "dynamic_int8", torch.bfloat16).scale.dtype == torch.float32
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    reference = x.float() @ (q.float() * scale.float()[:, None]).T
    assert (layer(x).float() - reference).abs().max() <= 0.02 * reference.abs().max()


@pytest.mark.parametrize("rows", [1, 16, 17, 100])
def test_weight_only_many_rows_convert_the_weight_a_chunk_at_a_time(monkeypatch, rows):
    """From WEIGHT_ONLY_MAX_ROWS rows on, the weight converted to bf16 (here 8 output rows at a time) and the output
    scaled: the same product as the int8 kernel's, to bf16's precision; with batch_invariant every row count takes
    the int8 kernel, so a row's output is the same alone or among 100."""
    from batchgen.models import quantization

    monkeypatch.setattr(quantization, "CONVERT_CHUNK_BYTES", 8 * 64 * 2)
    torch.manual_seed(0)
    q, scale = quantize_weight(torch.randn(44, 64), torch.bfloat16)
    layer = Int8Linear.from_int8(q, scale.float(), torch.randn(44, dtype=torch.bfloat16), "weight_only",
                               torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    reference = x.float() @ (q.float() * scale.float()[:, None]).T + layer.bias.float()
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 44)
    assert (out.float() - reference).abs().max() <= 0.02 * reference.abs().max()
    layer.batch_invariant = True
    alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(layer(x), alone)


def test_int8_linear_rows_are_independent_of_the_batch():
    """Each token's activations get their own scale: a row's output does not depend on the rows beside it."""
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(64, 32, bias=False))
    x = torch.randn(5, 64)
    x[2] *= 100  # an outlier row must not change the others' quantization
    assert torch.equal(layer(x)[0], layer(x[:1])[0])


def test_quantize_model_replaces_every_linear_and_keeps_the_logits(tiny_llama_dir):
    model = load_model(tiny_llama_dir, torch.float32, "cpu")
    before_bytes = weight_bytes(model)
    logits = _prefill_logits(model)
    quantize_model(model)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears == []  # every Linear is now an Int8Linear
    int8 = [name for name, m in model.named_modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 4 * model.num_layers + 1 and "lm_head" in int8
    assert all(is_quantized(f"{name}.weight") for name in int8)
    assert not is_quantized("model.embed_tokens.weight") and not is_quantized("model.layers.0.input_layernorm.weight")
    after = _prefill_logits(model)
    assert (after - logits).abs().max() <= 0.05 * logits.abs().max()
    assert (after.argmax(-1) == logits.argmax(-1)).float().mean() >= 0.75  # random tiny model: near ties
    # untied tiny model: embedding (fp32) stays, every matrix of the layers and the head shrinks 4x (plus scales)
    embed = model.model.embed_tokens.weight
    matrices = before_bytes - embed.numel() * 4 - _norm_bytes(model)
    assert weight_bytes(model) - embed.numel() * 4 - _norm_bytes(model) <= matrices / 4 * 1.1


def test_tied_model_keeps_its_embedding_and_quantizes_a_copy_for_the_head(tiny_qwen2_dir):
    model = load_model(tiny_qwen2_dir, torch.float32, "cpu")
    embedding = model.model.embed_tokens.weight.clone()
    quantize_model(model)
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # the lookup is unchanged, in the model dtype
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.bias is None
    assert (model.lm_head.dequantized() - embedding).abs().max() <= model.lm_head.scale.max() / 2 + 1e-6
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's q/k/v biases survive


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_int8_generates(tiny_llama_dir, dtype):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), dtype=dtype, quantization="int8", kv_cache_memory="16MiB"))
    assert isinstance(engine.model.model.layers[0].mlp.down_proj, Int8Linear)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 200], [7] * 40, list(range(3, 60))]
    results = sorted(engine.generate(Request(i, p, params) for i, p in enumerate(prompts)),
                     key=lambda r: r.request_id)
    assert [r.finish_reason for r in results] == ["length"] * 3
    assert all(len(r.token_ids) == 12 and all(0 <= t < engine.vocab_size for t in r.token_ids) for r in results)
    alone = list(engine.generate([Request("again", prompts[1], params)]))[0]
    assert alone.token_ids == results[1].token_ids


@pytest.mark.parametrize("value", ["int4", "INT8", True, 8, ""])
def test_invalid_quantization_is_a_setting_error(value):
    with pytest.raises(SettingError) as info:
        EngineArgs(quantization=value).validate()
    assert info.value.key == "quantization"


def test_job_file_takes_engine_quantization():
    from batchgen.job.config import parse_job
    from batchgen.job.keys import JobConfigError

    raw = {"input": {"path": "in.parquet"}, "output": {"path": "out"}, "engine": {"quantization": "int8"}}
    assert parse_job(raw).engine.quantization == "int8"
    assert parse_job({**raw, "engine": {}}).engine.quantization is None
    with pytest.raises(JobConfigError, match="engine.quantization"):
        parse_job({**raw, "engine": {"quantization": "int4"}})


def test_plan_weight_bytes_follow_quantization(tiny_llama_dir, tiny_qwen2_dir):
    from batchgen.job.plan.memory import inspect_model

    for model_dir in (tiny_llama_dir, tiny_qwen2_dir):
        model = load_model(model_dir, torch.float32, "cpu")
        _, plain = inspect_model(model_dir, torch.float32, True)
        assert plain.loaded == weight_bytes(model)
        quantize_model(model)
        _, int8 = inspect_model(model_dir, torch.float32, True, "int8")
        assert int8.loaded == weight_bytes(model) and int8.parameters == plain.parameters


def _prefill_logits(model) -> torch.Tensor:
    import numpy as np

    from batchgen_kernels import AttentionMetadata

    n, block = 40, 16
    blocks = -(-n // block)
    cache = torch.zeros((model.num_layers, 2, blocks, block, model.num_kv_heads, model.head_dim))
    model.bind_kv_cache([cache[i, 0] for i in range(model.num_layers)], [cache[i, 1] for i in range(model.num_layers)])
    metadata = AttentionMetadata.build([n], [n], np.arange(blocks, dtype=np.int32)[None], np.arange(n),
                                       torch.device("cpu"))
    ids = torch.arange(n) * 7 % model.vocab_size
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n), metadata))


def _norm_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "norm" in name)


def test_quantization_is_part_of_the_resume_fingerprint_only_when_on():
    from types import SimpleNamespace

    from batchgen.job.config import parse_job
    from batchgen.job.output.resume import describe_changes
    from batchgen.job.prepare import job_fingerprint

    raw = {"input": {"path": "in.parquet"}, "output": {"path": "out"}}
    no_inputs = SimpleNamespace(files=[], row_counts=[], sources=(), format="parquet")
    plain = job_fingerprint(parse_job(raw), "default", no_inputs)
    int8 = job_fingerprint(parse_job({**raw, "engine": {"quantization": "int8"}}), "default", no_inputs)
    assert "quantization" not in plain  # outputs written before the setting existed still resume
    assert describe_changes(plain, int8) == describe_changes(int8, plain) == "quantization changed"
    kv = job_fingerprint(parse_job({**raw, "engine": {"kv_cache_dtype": "int8"}}), "default", no_inputs)
    assert "kv_cache_dtype" not in plain and describe_changes(plain, kv) == "kv_cache_dtype, kv_int8_keys changed"
    before_turned_keys = {key: value for key, value in kv.items() if key != "kv_int8_keys"}
    assert describe_changes(before_turned_keys, kv) == "kv_int8_keys changed"  # such an output does not resume
    guessing = job_fingerprint(parse_job({**raw, "engine": {"speculative": {"method": "ngram"}}}), "default",
                               no_inputs)
    assert guessing == plain  # speculation changes no output: a run may resume with it turned on or off
