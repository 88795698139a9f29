"""The engine refuses, at construction, a model whose attention the Triton kernels cannot compile: the limits of
batchgen_kernels/triton_limits.py (where tests/test_triton_aot.py shows compilation stops), checked on this CPU
machine by handing the check a CUDA device it never uses."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

pytest.importorskip("triton")

from click.testing import CliRunner  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from batchgen.cli import main  # noqa: E402
from batchgen.engine import EngineArgs  # noqa: E402
from batchgen.engine.errors import SettingError  # noqa: E402
from batchgen.models.inspector import describe_config  # noqa: E402
from batchgen.engine.kernel_warmup import compile_attention_kernels  # noqa: E402
from batchgen.engine.startup import check_attention_shape  # noqa: E402
from batchgen_kernels.triton_limits import MAX_GROUP, MIN_HEAD_DIM, unsupported_reason  # noqa: E402

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


@pytest.fixture(autouse=True)
def triton_runs_on_cuda(monkeypatch):
    """As on a GPU whose probe kernel runs (kernels/batchgen_kernels/triton_probe.py): `auto` on CUDA means Triton."""
    from batchgen_kernels import triton_probe

    monkeypatch.setattr(triton_probe, "_results", {})
    monkeypatch.setattr(triton_probe, "launch", lambda device: None)


def described(head_dim):
    """The model the config builds, as the engine's start-up describes it (models/inspector.py)."""
    return describe_config(config(head_dim=head_dim))


def config(head_dim=64, heads=8, kv_heads=2):
    return LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)


def test_the_limits():
    assert unsupported_reason(64, 32, 8, torch.bfloat16) is None
    assert unsupported_reason(80, 12, 4, torch.float16) is None  # padded to 128
    assert unsupported_reason(MIN_HEAD_DIM, 4, 2, torch.float32) is None
    assert "below 16" in unsupported_reason(8, 4, 2, torch.bfloat16)
    assert unsupported_reason(256, 8, 1, torch.bfloat16) is None
    assert "1024-byte head row" in unsupported_reason(256, 8, 1, torch.float32)
    assert "1024-byte head row" in unsupported_reason(200, 8, 1, torch.float32)  # padded to 256
    assert unsupported_reason(64, MAX_GROUP, 1, torch.bfloat16) is None
    assert "more than 16" in unsupported_reason(64, 2 * MAX_GROUP, 1, torch.bfloat16)
    assert "do not divide" in unsupported_reason(64, 6, 4, torch.bfloat16)
    assert "dtype" in unsupported_reason(64, 8, 2, torch.float64)


def test_the_engine_refuses_an_unsupported_shape_on_cuda():
    with pytest.raises(SettingError, match=r"cannot run this model on CUDA: head_dim 8 is below 16.*attention_backend: "
                                           r"torch") as refused:
        check_attention_shape(EngineArgs(), CUDA, torch.bfloat16, described(head_dim=8))
    assert refused.value.key == "attention_backend"
    with pytest.raises(SettingError, match="head_dim 8"):
        check_attention_shape(EngineArgs(attention_backend="triton"), CUDA, torch.float32, described(head_dim=8))
    check_attention_shape(EngineArgs(), CUDA, torch.bfloat16, described(head_dim=64))
    # Where the Triton kernels do not run, their limits do not apply.
    check_attention_shape(EngineArgs(attention_backend="torch"), CUDA, torch.bfloat16, described(head_dim=8))
    check_attention_shape(EngineArgs(), torch.device("cpu"), torch.float32, described(head_dim=8))


def test_batchgen_run_exits_2_naming_the_reason(tmp_path, monkeypatch):
    """The CLI on a 'CUDA' machine (torch made to say so) with a head_dim-8 model: exit 2 and one line, before
    anything loads (the tiny model has not even a tokenizer: loading one would fail differently)."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_config(config(head_dim=8)).save_pretrained(model_dir)
    pq.write_table(pa.table({"prompt": ["hi", "there"]}), tmp_path / "in.parquet")
    job = {"model": str(model_dir), "device": "cuda",
           "input": {"path": str(tmp_path / "in.parquet"), "chat_template": False},
           "output": {"path": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--quiet"])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("batchgen: error: engine.attention_backend: the Triton attention kernels cannot run this "
                           "model on CUDA: head_dim 8 is below 16"), result.output


def test_a_kernel_that_fails_to_compile_at_warm_up_is_a_setting_error(monkeypatch):
    """On the GPU the warm-up compiles and launches every variant at construction: a failure the static limits do
    not foresee (shared memory of a smaller GPU, an architecture Triton cannot target) is refused there too."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from batchgen.engine import kernel_warmup

    inner = CompilationError(None, object(), "Input shapes should have M >= 1, N >= 1 and K >= 16")
    for error, reason in ((OutOfResources(115200, 101376, "shared memory"), "out of resource: shared memory"),
                          (CompilationError("def kernel(): ...", object()), "K >= 16")):
        if reason == "K >= 16":
            error.__cause__ = inner

        def fail(model, max_model_len, error=error):
            raise error

        monkeypatch.setattr(kernel_warmup, "warm_up_attention", fail)
        with pytest.raises(SettingError, match=f"cannot run this model on this GPU .*{reason}.*attention_backend: "
                                               f"torch") as refused:
            compile_attention_kernels(None, 512)
        assert refused.value.key == "attention_backend"
