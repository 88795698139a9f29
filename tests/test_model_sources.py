"""Where a model comes from (issue 24): a Hugging Face hub id found in a cache laid out as huggingface_hub writes
it (refs/<ref> holding a commit, snapshots/<commit>/ of relative symlinks into blobs/), pinned to that commit in
the fingerprint and _SUCCESS; absent and offline, exit 2 naming the id and where it looked; downloaded through a
stand-in for huggingface_hub's snapshot_download when online (this machine cannot reach the hub); a sharded
checkpoint's index authoritative; tied and untied heads giving transformers' greedy tokens."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from click.testing import CliRunner
from conftest import _TINY, save_tiny_model
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import save_file
from test_engine import greedy, make_engine, random_prompts, run
from test_hardening import job_error, set_keys
from test_resume import make_job
from transformers import AutoModelForCausalLM, LlamaConfig

from batchgen.bench.greedy_check import assert_greedy_matches, hf_greedy
from batchgen.cli import main
from batchgen.job.prepare import check_model
from batchgen.models.hub import HubId, parse_hub_id
from batchgen.models.loader import ModelNotFoundError, load_model, model_id, resolve_model

COMMIT_A, COMMIT_B = "a1" * 20, "b2" * 20


def cache_snapshot(cache: Path, repo_id: str, commit: str, source: Path, refs: tuple[str, ...] = ("main",),
                   names: list[str] | None = None) -> Path:
    """Put `source`'s files (or those of `names`) into the HF cache `cache` as commit `commit` of `repo_id`: each
    file a blob named by its hash, linked from snapshots/<commit>/; each of `refs` then points at the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    names = names if names is not None else [str(p.relative_to(source)) for p in source.rglob("*") if p.is_file()]
    for name in sorted(names):
        data = (source / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (untied head) saved in several shards with model.safetensors.index.json."""
    config = LlamaConfig(**_TINY, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    path = save_tiny_model(config, tmp_path_factory.mktemp("sharded"), seed=4, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").exists()
    return path


@pytest.fixture(scope="module")
def chat_dir(default_model_dir, tmp_path_factory) -> Path:
    """A tiny random Llama that a job can run: the default model's vocabulary, tokenizer and chat template."""
    config = LlamaConfig(**{**_TINY, "vocab_size": 49152}, tie_word_embeddings=True,
                         architectures=["LlamaForCausalLM"])
    path = save_tiny_model(config, tmp_path_factory.mktemp("chat"), seed=5)
    for file in default_model_dir.iterdir():
        if file.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(file, path / file.name)
    return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def same_weights(a: Path, b: Path) -> None:
    first, second = (load_model(path, torch.float32, "cpu").state_dict() for path in (a, b))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


# -- hub ids and the cache --------------------------------------------------------------------------------------------

def test_what_is_a_hub_id(tmp_path, monkeypatch):
    assert parse_hub_id("org/name") == HubId("org/name", None)
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct@v1.0") == HubId("Qwen/Qwen2.5-0.5B-Instruct", "v1.0")
    assert parse_hub_id("org/name@refs/pr/1") == HubId("org/name", "refs/pr/1")
    for ref in ("default", "name", "/abs/org/name", "./org/name", "a/b/c", "org/name.gguf", "org/na--me",
                "org/name@", "org/name@../../x", "~/models"):
        assert parse_hub_id(ref) is None, ref
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)  # a directory that exists is a path, whatever its form
    assert parse_hub_id("org/name") is None
    # the fingerprint of a default or local model is what it always was: outputs made before still resume
    assert model_id("default", Path("/anywhere")) == "default"
    assert model_id("org/name", tmp_path / "org" / "name") == str((tmp_path / "org" / "name").resolve())


def test_cache_hit_by_branch_tag_and_commit(hub_cache, sharded_dir):
    snapshot = cache_snapshot(hub_cache, "org/tiny", COMMIT_A, sharded_dir, refs=("main", "v1"))
    assert (snapshot / "config.json").is_symlink()
    for ref in ("org/tiny", "org/tiny@main", "org/tiny@v1", f"org/tiny@{COMMIT_A}"):
        assert resolve_model(ref) == snapshot, ref
        assert check_model(ref) == f"org/tiny@{COMMIT_A}", ref
    same_weights(snapshot, sharded_dir)
    with pytest.raises(ModelNotFoundError, match=r"'org/tiny@v2' not found: .*models--org--tiny"):
        resolve_model("org/tiny@v2")


def test_hf_hub_cache_comes_before_hf_home(tmp_path, monkeypatch, sharded_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    in_home = cache_snapshot(tmp_path / "home" / "hub", "org/tiny", COMMIT_A, sharded_dir)
    in_cache = cache_snapshot(tmp_path / "cache", "org/tiny", COMMIT_B, sharded_dir)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert resolve_model("org/tiny") == in_cache
    monkeypatch.delenv("HF_HUB_CACHE")
    assert resolve_model("org/tiny") == in_home


def test_offline_and_absent_exits_2_naming_the_id_and_where_it_looked(hub_cache, tmp_path):
    job = set_keys(make_job(tmp_path, 2), model="org/absent")
    message = job_error(job)
    assert message.startswith("batchgen: error: model: 'org/absent' not found: no such local path, and not in "
                              f"the Hugging Face cache (looked in {hub_cache / 'models--org--absent'}, set by "
                              "HF_HUB_CACHE); HF_HUB_OFFLINE=1 forbids downloading it"), message
    assert not (tmp_path / "out").exists()


def test_incomplete_snapshot_offline_names_what_is_missing(hub_cache, sharded_dir):
    shard = sorted(sharded_dir.glob("*.safetensors"))[1].name
    names = [p.name for p in sharded_dir.iterdir() if p.name != shard]
    cache_snapshot(hub_cache, "org/tiny", COMMIT_A, sharded_dir, names=names)  # an interrupted download
    with pytest.raises(ModelNotFoundError, match=rf"'org/tiny' is incomplete in the Hugging Face cache \(.*{shard} "
                                                 r"is not in .*\); HF_HUB_OFFLINE=1 forbids downloading it"):
        resolve_model("org/tiny")


# -- downloading, through a stand-in for huggingface_hub --------------------------------------------------------------

class FakeHub:
    """snapshot_download of one repository at COMMIT_A, served from `remote`: the files its allow_patterns select
    (huggingface_hub's own filter) are put into the cache, and the snapshot directory returned."""

    def __init__(self, remote: Path):
        self.remote, self.calls = remote, []

    def __call__(self, repo_id, *, revision=None, cache_dir=None, allow_patterns=None, **kwargs):
        self.calls.append((revision, allow_patterns))
        assert revision in (None, "main", COMMIT_A)
        files = [str(p.relative_to(self.remote)) for p in self.remote.rglob("*") if p.is_file()]
        names = list(filter_repo_objects(items=files, allow_patterns=allow_patterns))
        return str(cache_snapshot(Path(cache_dir), repo_id, COMMIT_A, self.remote, names=names))


@pytest.fixture
def online(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return hub_cache


def test_online_download_fetches_only_what_batchgen_reads(online, monkeypatch, sharded_dir, tmp_path):
    remote = tmp_path / "remote"
    shutil.copytree(sharded_dir, remote)
    (remote / "README.md").write_text("a model card")
    (remote / "pytorch_model.bin").write_bytes(b"pickled weights")
    (remote / "original").mkdir()
    shutil.copy(next(sharded_dir.glob("*.safetensors")), remote / "original" / "consolidated.safetensors")
    fake = FakeHub(remote)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)

    snapshot = resolve_model("org/remote")
    assert snapshot == online / "models--org--remote" / "snapshots" / COMMIT_A
    assert sorted(p.name for p in snapshot.rglob("*")) == sorted(p.name for p in sharded_dir.iterdir())
    assert [revision for revision, _ in fake.calls] == [None, COMMIT_A]  # the shards at the commit of the index
    same_weights(snapshot, sharded_dir)
    assert check_model("org/remote") == f"org/remote@{COMMIT_A}" and len(fake.calls) == 2  # now from the cache


def test_failed_download_says_why(online, monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelNotFoundError, match=r"'org/remote' not found: .*models--org--remote.*; downloading it "
                                                 r"failed \(ConnectionError: no route to huggingface\.co\)"):
        resolve_model("org/remote")


def test_plan_downloads_nothing(online, monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("plan downloaded")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    result = CliRunner().invoke(main, ["plan", str(set_keys(make_job(tmp_path, 2), model="org/remote"))])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().endswith("HF_HUB_CACHE); batchgen plan downloads nothing (batchgen run would "
                                          "download it)"), result.stderr


# -- the commit pinned: plan, _SUCCESS and resume ---------------------------------------------------------------------

def test_fingerprint_pins_the_commit_and_a_moved_branch_is_refused(hub_cache, chat_dir, tmp_path):
    cache_snapshot(hub_cache, "org/chat", COMMIT_A, chat_dir)
    job = set_keys(make_job(tmp_path, 2, sampling={"max_tokens": 4}), model="org/chat")
    out = tmp_path / "out"

    plan = CliRunner().invoke(main, ["plan", str(job)])
    assert plan.exit_code == 0 and f"valid: model org/chat@{COMMIT_A} (" in plan.output, plan.output
    first = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert first.exit_code == 0, (first.output, first.exception)
    success = json.loads((out / "_SUCCESS").read_text())
    assert success["model"] == success["fingerprint"]["model"] == f"org/chat@{COMMIT_A}"
    assert success["job"]["model"] == "org/chat"

    cache_snapshot(hub_cache, "org/chat", COMMIT_B, chat_dir)  # main moves to a new commit (same files here)
    message = job_error(job)
    assert message == (f"batchgen: error: output.path: {out} holds rows of a different job (model changed); "
                       f"re-run with --overwrite to start over, or choose another output.path")
    again = CliRunner().invoke(main, ["run", str(set_keys(job, model=f"org/chat@{COMMIT_A}")), "--quiet"])
    assert again.exit_code == 0 and "is already complete" in again.stderr, again.output


# -- sharded checkpoints: the index decides -------------------------------------------------------------------------

def test_the_index_names_the_shards(sharded_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(sharded_dir, model_dir)
    # a stray file the index does not name (a leftover of another save) is not read, as in transformers
    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(model_dir / "zz-stray.safetensors"))
    same_weights(model_dir, sharded_dir)

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (model_dir / shard).unlink()
    job = set_keys(make_job(tmp_path, 2), model=str(model_dir))
    message = job_error(job)
    assert f"batchgen: error: model: {model_dir}/model.safetensors.index.json names " in message, message
    assert f"but {shard} is not in {model_dir}" in message
    assert not (tmp_path / "out").exists()


# -- tied and untied heads against transformers ----------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tied_and_untied_heads_give_transformers_greedy_tokens(tied, tmp_path):
    config = LlamaConfig(**_TINY, tie_word_embeddings=tied, architectures=["LlamaForCausalLM"])
    model_dir = save_tiny_model(config, tmp_path / "model", seed=6, max_shard_size="40KB")
    stored = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in stored) is not tied

    ours = load_model(model_dir, torch.float32, "cpu")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) is tied
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)

    hf.generation_config.eos_token_id = None  # random weights: every prompt runs to max_tokens, like ignore_eos
    prompts = random_prompts(7, 6, config.vocab_size)
    references = [hf_greedy(hf, prompt, 12) for prompt in prompts]
    outputs = [result.token_ids for result in run(make_engine(model_dir), prompts, greedy(12))]
    assert_greedy_matches(hf, prompts, references, outputs)
