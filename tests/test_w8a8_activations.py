"""W8A8's calibrated activations (quantization_calibration.activations: dynamic, static, smooth;
models/int8_activations.py, engine/calibration.py): SmoothQuant's folding is exact in fp32, static and smoothed
layers stay close to the float model, the settings' errors name their keys, and a job records the choice, resumes
with it, and the quality gate reads its _calibration.json back. On the tiny random Llama."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from torch import nn

from batchgen.engine import Engine, EngineArgs
from batchgen.engine.calibration import _as_linear, _next_token_logits, measure, quantizable_layers
from batchgen.engine.errors import SettingError
from batchgen.engine.engine_args import SMOOTH_ALPHAS
from batchgen.models.int8_activations import fold_smoothing, smoothing_factors
from batchgen.models.quantization import DEFAULT_KEEP, Int8Linear, is_kept
from cli_runs import kill_after_parts, run_cli
from conftest import _TINY, save_tiny_model
from test_plan import write_input, write_job

PROMPTS = [[1, 5, 9, 200, 17, 3], list(range(3, 40)), [7] * 12, list(range(100, 130))]


@pytest.fixture(scope="module")
def tiny_vocab_model(default_model_dir, tmp_path_factory):
    """A tiny random Llama with the default model's vocabulary and tokenizer: a job's prompts run on it."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{**_TINY, "vocab_size": 49152}, architectures=["LlamaForCausalLM"])
    model = save_tiny_model(config, tmp_path_factory.mktemp("tiny_vocab"))
    for path in default_model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(path, model / path.name)
    return model


class SmoothedLinear(nn.Linear):
    """A float Linear with SmoothQuant's runtime 1/s (what Int8Linear.smooth is before fold_smoothing)."""

    def forward(self, x):
        return super().forward(x if self.smooth is None else x * self.smooth)


def test_smoothing_folded_into_the_norms_and_up_rows_is_the_original_model_in_fp32(tiny_llama_dir):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
                               enable_prefix_caching=False))
    model, want = engine.model, next_logits(engine)
    generator = torch.Generator().manual_seed(0)
    for name in quantizable_layers(model):
        if is_kept(name, DEFAULT_KEEP):
            continue
        linear = _as_linear(model.get_submodule(name))  # the engine's packed weight read back
        s = smoothing_factors(torch.rand(linear.in_features, generator=generator) * 50, linear.weight, 0.5)
        smoothed = SmoothedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        smoothed.weight.data, smoothed.smooth = linear.weight.detach() * s, 1.0 / s
        smoothed.bias = linear.bias
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, smoothed)
    assert fold_smoothing(model) == 3 * len(model.model.layers)  # qkv, gate_up into the norms; down into up rows
    assert all(getattr(m, "smooth", None) is None for m in model.modules())
    got = next_logits(engine)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.fixture(scope="module")
def calibrated(tiny_llama_dir):
    """The float engine's next-token logits, and each activations choice's scales measured on PROMPTS."""
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
                               enable_prefix_caching=False))
    layers = [name for name in quantizable_layers(engine.model) if not is_kept(name, DEFAULT_KEEP)]
    found = {choice: measure(engine, PROMPTS, layers, choice) for choice in ("dynamic", "static", "smooth")}
    found["smooth at 0.5"] = measure(engine, PROMPTS, layers, "smooth", alpha=0.5, sensitivities=False)
    reference = next_logits(engine)
    del engine
    return reference, found


def next_logits(engine) -> torch.Tensor:
    return _next_token_logits(engine, PROMPTS)


@pytest.mark.parametrize("choice", ["static", "smooth"])
def test_static_and_smoothed_activations_stay_close_to_the_float_model(tiny_llama_dir, calibrated, choice):
    reference, found = calibrated
    scales = found[choice].scales
    if choice == "smooth":  # no alpha given: each of the grid tried with every layer in int8, the nearest taken
        searched = found["smooth"].alpha_kl
        assert set(searched) == set(SMOOTH_ALPHAS) and found["smooth"].alpha == min(searched, key=searched.get)
        assert found["smooth at 0.5"].alpha == 0.5 and found["smooth at 0.5"].alpha_kl == {}
        assert (found["smooth at 0.5"].scales == scales) == (found["smooth"].alpha == 0.5)
    assert set(scales) == set(found[choice].channel_max) and len(scales) == 3 * 2
    assert all(isinstance(v, float) if choice == "static" else len(v) > 1 for v in scales.values())
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
                               enable_prefix_caching=False, quantization="int8", quantization_keep=DEFAULT_KEEP,
                               quantization_scales=scales))
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 3 * 2
    assert {m.activations for m in layers} == {"static_int8" if choice == "static" else "dynamic_int8"}
    assert all(m.smooth is None for m in layers)  # every smoothing folded (into the norms, the up rows)
    got = next_logits(engine)
    error = float((got - reference).abs().max() / reference.abs().max())
    print(choice, error)
    assert error < 0.05, error
    # the sensitivities were those of the variant: a layer measured with its scales, not the dynamic one
    assert found[choice].sensitivity != found["dynamic"].sensitivity


@pytest.mark.parametrize("calibration, key", [({"rows": 2, "activations": "smoth"}, "activations"),
                                              ({"rows": 2, "activations": "smooth", "alpha": 1.5}, "alpha")])
def test_a_bad_activations_setting_names_its_key(calibration, key):
    with pytest.raises(SettingError) as info:
        EngineArgs(quantization="int8", quantization_calibration=calibration).validate()
    assert info.value.key == f"quantization_calibration.{key}" and f"quantization_calibration.{key}" in str(info.value)
    with pytest.raises(SettingError) as info:
        EngineArgs(quantization_scales={"lm_head": 1.0}).validate()
    assert info.value.key == "quantization_scales"


def test_a_static_job_records_its_choice_resumes_with_it_and_the_gate_reads_it_back(tmp_path, tiny_vocab_model):
    prompts = [f"Review {i}: the kettle {'works' if i % 2 else 'leaks'} after {i} weeks." for i in range(8)]
    job = write_job(tmp_path, tiny_vocab_model, write_input(tmp_path / "in.parquet", prompts),
                    engine={"quantization": "int8", "max_num_seqs": 2, "max_num_batched_tokens": 256, "kv_cache_memory": "16MiB",
                            "quantization_calibration": {"rows": 2, "activations": "static"}},
                    input={"chat_template": False}, output={"rows_per_part": 2, "commit_interval_s": 0.1})
    out = tmp_path / "out"
    kill_after_parts(job, out, 1)
    cached = json.loads((out / "_calibration.json").read_text())
    assert cached["activations"] == "static" and len(cached["activation_scales"]) == 3 * 2
    # the resumed run builds its engine from the record, not a new measurement: a scale written into it is used
    layer = next(iter(cached["activation_scales"]))
    cached["activation_scales"][layer] = 0.125
    (out / "_calibration.json").write_text(json.dumps(cached))
    done = run_cli(job)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "_SUCCESS").read_text())
    calibration = summary["quantization_calibration"]
    assert calibration["activations"] == "static" and calibration["static_scales"][layer] == 0.125
    assert summary["fingerprint"]["quantization_calibration"] == {"rows": 2, "activations": "static"}
    gate = subprocess.run([sys.executable, "-m", "batchgen", "plan", str(job), "--quality", "2", "--no-probe"],
                          capture_output=True, text=True, timeout=600)
    assert gate.returncode == 0, gate.stderr[-2000:]
    assert "quality: calibration read from the output's _calibration.json" in gate.stdout, gate.stdout
    assert "static activations" in gate.stdout
    spec = yaml.safe_load(job.read_text())
    spec["output"]["path"] = str(tmp_path / "elsewhere")
    (tmp_path / "elsewhere.yaml").write_text(yaml.safe_dump(spec))
    gate = subprocess.run([sys.executable, "-m", "batchgen", "plan", str(tmp_path / "elsewhere.yaml"), "--quality",
                           "2", "--no-probe"], capture_output=True, text=True, timeout=600)
    assert gate.returncode == 0 and "calibration measured now" in gate.stdout, gate.stdout
    assert not (tmp_path / "elsewhere" / "_calibration.json").exists()


def test_scales_on_int8_weights_already_quantized_requantize_them(tiny_llama_dir, calibrated):
    """A model stored in int8 (a converted GGUF) gets its scales after loading (quantization.apply_to_stored): a
    static scale set, smoothing factors multiplied into the dequantized weight and requantized, then folded."""
    from batchgen.models.quantization import apply_to_stored

    reference, found = calibrated
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
                               enable_prefix_caching=False, quantization="int8", quantization_keep=DEFAULT_KEEP))
    apply_to_stored(engine.model, found["smooth"].scales)
    assert fold_smoothing(engine.model) == 3 * 2
    error = float((next_logits(engine) - reference).abs().max() / reference.abs().max())
    assert error < 0.05, error
