"""The CPU's fused elementwise kernels and oneDNN-packed linear layers against the torch ops they replace."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen.models.packed_linear import PackedLinear, pack_linears, packing_supported
from batchgen_kernels import cpu_build
from batchgen_kernels.elementwise import FusedCpuElementwise, TorchElementwise, get_elementwise

needs_kernels = pytest.mark.skipif(not cpu_build.load(), reason="the C++ CPU kernels did not build on this machine")

DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to rounding: fp32 within a few ulps (a sum's order, exp's last bit); in bf16 at most one bf16 step
    apart where an fp32 intermediate sat on a rounding boundary."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=4e-6, atol=4e-6)
    else:
        torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-2)
        assert (a != b).float().mean() < 0.01  # and almost everywhere identical


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_fused_ops_match_torch(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    hidden, heads, kv_heads, dim = 96, 6, 2, 16
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    positions = torch.randint(0, 1000, (tokens,), generator=g)
    angles = torch.outer(torch.arange(1000, dtype=torch.float32), torch.rand(dim // 2, generator=g))
    cos, sin = angles.cos(), angles.sin()
    gate_up = (3 * torch.randn(tokens, 2 * 40, generator=g)).to(dtype)

    close(FusedCpuElementwise.rms_norm(x, weight, 1e-6), TorchElementwise.rms_norm(x, weight, 1e-6), dtype)
    for got, want in zip(FusedCpuElementwise.add_rms_norm(x, residual, weight, 1e-6),
                         TorchElementwise.add_rms_norm(x, residual, weight, 1e-6)):
        close(got, want, dtype)
    for got, want in zip(FusedCpuElementwise.rope_qk(qkv, positions, cos, sin, heads, kv_heads, dim),
                         TorchElementwise.rope_qk(qkv, positions, cos, sin, heads, kv_heads, dim)):
        assert torch.equal(got, want)  # no reduction, no FMA contraction: bit-exact
    close(FusedCpuElementwise.silu_mul(gate_up), TorchElementwise.silu_mul(gate_up), dtype)


@needs_kernels
def test_fused_ops_take_the_residual_add_exactly_and_reject_bad_shapes():
    x = torch.randn(3, 8)
    residual = torch.randn(3, 8)
    hidden, _ = FusedCpuElementwise.add_rms_norm(x, residual, torch.ones(8), 1e-6)
    assert torch.equal(hidden, residual + x)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        FusedCpuElementwise.rope_qk(torch.randn(1, 4 * 4), torch.tensor([10]), torch.ones(5, 2), torch.ones(5, 2),
                                    2, 1, 4)
    with pytest.raises(RuntimeError, match="weight must be"):
        FusedCpuElementwise.rms_norm(x, torch.ones(7), 1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_vector_and_tail_lanes_agree(dtype):
    """silu_mul runs 16 lanes at a time and the row's tail one by one: the same values give the same bits in both,
    a NaN stays a NaN in both."""
    gate = (3 * torch.randn(37, generator=torch.Generator().manual_seed(0))).to(dtype)
    gate[[3, 36]] = float("nan")
    up = torch.ones(37, dtype=dtype)
    out = FusedCpuElementwise.silu_mul(torch.cat([gate, up])[None])[0]  # lanes 0-31 vectorized, 32-36 the tail
    shifted = FusedCpuElementwise.silu_mul(torch.cat([gate[32:], up[32:]])[None])[0]  # those 5 alone: all tail
    assert torch.isnan(out[[3, 36]]).all() and not torch.isnan(out[[0, 1, 2, 4, 35]]).any()
    assert torch.equal(out[32:].nan_to_num(), shifted.nan_to_num())
    scalar = torch.cat([FusedCpuElementwise.silu_mul(torch.stack([gate[i:i + 1], up[i:i + 1]], 1))
                        for i in range(16)])[:, 0]  # one element a row: lanes 0-15 through the scalar loop
    assert torch.equal(out[:16].nan_to_num(), scalar.nan_to_num())


def test_get_elementwise_falls_back_to_torch_ops():
    assert get_elementwise("cpu", fused=False) is TorchElementwise
    assert get_elementwise("meta", fused=True) is TorchElementwise


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="torch without oneDNN")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64, 257])
def test_packed_linear_matches_f_linear(dtype, rows):
    if not packing_supported(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN has no {dtype} kernels for this CPU")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 80, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    want = F.linear(x.double(), weight.double(), bias.double())
    layer = PackedLinear(weight, bias)
    weight.fill_(float("nan"))  # the loader reads the next weight into the same buffer: the packed copy owns its own
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 48)
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="torch without oneDNN")
def test_pack_linears_replaces_every_linear_and_keeps_a_tied_embedding():
    model = nn.Module()
    model.embed = nn.Embedding(10, 8)
    model.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8, bias=False))
    model.head = nn.Linear(8, 10, bias=False)
    model.head.weight = model.embed.weight  # tied
    x = torch.randn(3, 8)
    want = model.head(model.block(x))
    assert pack_linears(model) == 3
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.embed.weight, nn.Parameter)  # the embedding still looks tokens up
    torch.testing.assert_close(model.head(model.block(x)), want, rtol=1e-5, atol=1e-5)
