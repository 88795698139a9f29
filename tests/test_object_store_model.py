"""model: s3://bucket/prefix/ (README, "Object storage"): a model directory in a real S3-protocol server (moto's,
started here) is downloaded once into batchgen's cache, gives the same output as the same directory on disk, is
reused by the next run without a download, and a rewritten object makes another cache entry, which the job's
fingerprint tells apart (a resume on the other version is refused)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from conftest import save_tiny_model
from s3_server import start_s3_server

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "data" / "samples" / "prompts.parquet"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama with the default model's tokenizer (its 49,152-token vocabulary)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    path = save_tiny_model(config, tmp_path_factory.mktemp("tiny") / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def s3(model_dir):
    server = start_s3_server()
    client = server.client()
    client.create_bucket(Bucket="models")
    for file in model_dir.iterdir():
        client.upload_file(str(file), "models", f"tiny/{file.name}")
    yield server
    server.stop()


def write_job(tmp_path: Path, name: str, model: str) -> Path:
    job = {"model": model, "dtype": "float32",
           "input": {"path": str(PROMPTS), "id_column": "id", "prompt_column": "prompt", "chat_template": False},
           "sampling": {"max_tokens": 6, "temperature": 0.0}, "engine": {"kv_cache_memory": "64MiB"},
           "output": {"path": str(tmp_path / name)}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run(job: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], capture_output=True,
                          text=True, timeout=900, env=env)


def texts(out: Path) -> pl.DataFrame:
    return pl.read_parquet(f"{out}/*.parquet").select("id", "text", "output_tokens").sort("id")


def test_a_model_in_the_store_is_downloaded_once_and_pinned(tmp_path, s3, model_dir):
    env = s3.env(BATCHGEN_CACHE_DIR=str(tmp_path / "cache"), BATCHGEN_NO_CPU_KERNELS="1")
    local = run(write_job(tmp_path, "local", str(model_dir)), env)
    assert local.returncode == 0, local.stderr[-3000:]
    remote = run(write_job(tmp_path, "remote", "s3://models/tiny/"), env)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert texts(tmp_path / "remote").equals(texts(tmp_path / "local"))
    entries = list((tmp_path / "cache" / "object-models").iterdir())
    assert len(entries) == 1 and (entries[0] / "model.safetensors").stat().st_size == \
        (model_dir / "model.safetensors").stat().st_size
    fingerprint = json.loads((tmp_path / "remote" / "_SUCCESS").read_text())["fingerprint"]
    assert fingerprint["model"] == str(entries[0])

    weights = entries[0] / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = run(write_job(tmp_path, "again", "s3://models/tiny"), env)  # reused: not downloaded again
    assert again.returncode == 0, again.stderr[-3000:]
    assert weights.stat().st_mtime_ns == before and len(list(entries[0].parent.iterdir())) == 1

    config = json.loads((model_dir / "config.json").read_text())
    s3.client().put_object(Bucket="models", Key="tiny/config.json",  # the same model, another object version
                           Body=json.dumps(config, indent=1).encode())
    resumed = run(write_job(tmp_path, "remote", "s3://models/tiny/"), env)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "model" in resumed.stderr
    assert len([e for e in entries[0].parent.iterdir() if not e.name.startswith(".")]) == 2


def test_a_prefix_without_a_model_is_a_job_error(tmp_path, s3):
    result = run(write_job(tmp_path, "out", "s3://models/nothing/"), s3.env(BATCHGEN_CACHE_DIR=str(tmp_path / "c")))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "model: s3://models/nothing/ holds no config.json" in result.stderr
