"""A long CPU prefill's MLP runs in row slices (llama.CPU_MLP_ROWS, issue 43): the same result as one call, no
one-row slice, and layers that are not plain packed ones (a LoRA layer reads the step's rows whole) run in one call."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batchgen.models import llama
from batchgen.models.packed_linear import PackedLinear, packing_supported
from batchgen_kernels.elementwise import TorchElementwise

pytestmark = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN")


def packed_mlp(hidden: int = 64, intermediate: int = 128) -> llama.MLP:
    torch.manual_seed(0)
    mlp = llama.MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=intermediate), llama.LlamaVariant())
    mlp.gate_up_proj = PackedLinear(mlp.gate_up_proj.weight.data, None)
    mlp.down_proj = PackedLinear(mlp.down_proj.weight.data, None)
    return mlp


def test_sliced_mlp_equals_one_call(monkeypatch):
    mlp, ops = packed_mlp(), TorchElementwise()
    x = torch.randn(1201, 64)
    calls = []
    real = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, rows: calls.append(rows.shape[0]) or real(self, rows))
    monkeypatch.setattr(llama, "CPU_MLP_ROWS", 10**9)
    whole = mlp(x, ops)
    assert calls == [1201, 1201]
    calls.clear()
    monkeypatch.setattr(llama, "CPU_MLP_ROWS", 512)
    sliced = mlp(x, ops)
    assert sorted(set(calls)) == [600, 601] and len(calls) == 4  # two slices, none of one row
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-6)


def test_other_layers_run_in_one_call(monkeypatch):
    mlp = packed_mlp()
    mlp.down_proj = torch.nn.Linear(128, 64, bias=False)  # e.g. a wrapper that is not a PackedLinear
    monkeypatch.setattr(llama, "CPU_MLP_ROWS", 16)
    seen = []
    mlp.down_proj.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    mlp(torch.randn(100, 64), TorchElementwise())
    assert seen == [100]
