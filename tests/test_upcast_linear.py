"""bf16 Linear layers computed in fp32 on a CPU without native bf16 (models/upcast_linear.py): the same products as
one fp32 matmul rounded to bf16, sliced or not, few rows on torch's bf16 kernel, and the loader's use of them."""
import pytest
import torch
import torch.nn.functional as F

from batchgen.models import upcast_linear
from batchgen.models.loader import load_model
from batchgen.models.upcast_linear import UPCAST_MIN_ROWS, UpcastLinear, upcast_supported

needs_upcast = pytest.mark.skipif(not upcast_supported(torch.device("cpu"), torch.bfloat16),
                                  reason="this CPU has native bf16: its bf16 Linear layers are oneDNN-packed")


def layer_and_input(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(48, 80, generator=g).bfloat16()
    bias = torch.randn(48, generator=g).bfloat16()
    return weight, bias, torch.randn(rows, 80, generator=g).bfloat16()


@pytest.mark.parametrize("rows", [UPCAST_MIN_ROWS, 64, 257])
def test_rows_from_the_threshold_are_one_fp32_product_rounded_once(monkeypatch, rows):
    monkeypatch.setattr(upcast_linear, "SLICE_BYTES", 4 * 80 * 10)  # 10 output rows a slice: 5 slices
    weight, bias, x = layer_and_input(rows)
    layer = UpcastLinear(weight, bias)
    assert layer.slice_rows == 10
    got = layer(x)
    want = F.linear(x.float(), weight.float(), bias.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert (got != want).float().mean() < 0.01  # an fp32 sum's order may move a value across a rounding boundary


def test_fewer_rows_stay_on_torchs_bf16_kernel():
    weight, bias, x = layer_and_input(UPCAST_MIN_ROWS - 1)
    assert torch.equal(UpcastLinear(weight, bias)(x), F.linear(x, weight, bias))


def test_any_leading_shape_and_no_bias():
    weight, _, x = layer_and_input(2 * UPCAST_MIN_ROWS)
    layer = UpcastLinear(weight, None)
    got = layer(x.view(2, UPCAST_MIN_ROWS, 80))
    assert got.shape == (2, UPCAST_MIN_ROWS, 48)
    assert torch.equal(got.view(-1, 48), layer(x))


@needs_upcast
def test_the_loader_gives_bf16_linears_their_fp32_form_and_keeps_one_copy(tiny_llama_dir):
    model = load_model(tiny_llama_dir, torch.bfloat16, "cpu", pack=True)
    layers = [m for m in model.modules() if isinstance(m, UpcastLinear)]
    assert layers and not any(type(m) is torch.nn.Linear for m in model.modules())
    assert all(layer.weight.dtype == torch.bfloat16 for layer in layers)
    plain = load_model(tiny_llama_dir, torch.bfloat16, "cpu")  # the same weights as plain nn.Linear layers
    ours = model.state_dict()
    for name, tensor in plain.state_dict().items():  # each layer its own weight (none in a buffer the loader reuses)
        assert torch.equal(ours[name], tensor), name
