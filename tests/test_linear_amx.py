"""The AMX bf16 Linear (csrc/amx/linear_amx.cpp, torch.ops.batchgen.linear_amx) against F.linear in fp32 on the same
bf16 inputs: the tile kernel (few rows) and the brgemm path (many) on the 1B shapes' K and N and odd ones (K not a
multiple of 32, N not of 16 or 32), rows 1-130, with and without a bias; a row's bits whatever its company on the
tile path; and PackedLinear.make_batch_invariant (engine.batch_invariant in bf16) on it: a row's bits alone, in any
batch and at 1 or 2 threads. Skipped where the CPU has no AMX. (Its library, amx.LINEAR, is loaded only where asked:
amx.load_linear.)"""
import pytest
import torch
import torch.nn.functional as F

from batchgen_kernels import amx

if not amx.available():
    pytest.skip(f"no AMX tiles here ({amx.status().reason})", allow_module_level=True)
amx.load_linear()


def case(rows, k, n, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    return w, x, b, expected


def assert_bf16_close(out, expected):
    """Within the output's bf16 rounding (half an ulp: 2^-9 relative) plus the fp32 sums' order."""
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("k,n", [(2048, 3072), (8192, 64), (96, 48), (40, 17), (33, 100), (2050, 70), (16, 1)])
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 100, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tile_rows", [0, 256])  # brgemm for every row count; the tiles for every one
def test_against_f_linear(k, n, rows, bias, tile_rows):
    w, x, b, expected = case(rows, k, n, bias)
    out = torch.ops.batchgen.linear_amx(x, torch.ops.batchgen.linear_amx_pack(w), b, n, tile_rows)
    assert_bf16_close(out, expected)


def test_leading_dimensions_and_a_strided_input():
    w, x, b, expected = case(12, 80, 40, True)
    packed = torch.ops.batchgen.linear_amx_pack(w)
    out = torch.ops.batchgen.linear_amx(x.reshape(3, 4, 80), packed, b, 40, 64)
    assert out.shape == (3, 4, 40)
    assert_bf16_close(out.reshape(12, 40), expected)
    wide = torch.cat([x, x], dim=1)[:, :80]  # rows 160 apart
    assert_bf16_close(torch.ops.batchgen.linear_amx(wide, packed, b, 40, 0), expected)
    assert torch.ops.batchgen.linear_amx(x[:0], packed, b, 40, 64).shape == (0, 40)


def test_a_rows_bits_do_not_depend_on_its_company_on_the_tiles():
    w, x, b, _ = case(64, 256, 96, True)
    packed = torch.ops.batchgen.linear_amx_pack(w)
    together = torch.ops.batchgen.linear_amx(x, packed, b, 96, 64)
    for rows in (1, 7, 16, 33):
        assert torch.equal(torch.ops.batchgen.linear_amx(x[:rows], packed, b, 96, 64), together[:rows])


@pytest.mark.parametrize("k,n", [(2048, 3072), (8192, 2048), (40, 17)])
def test_a_batch_invariant_packed_linear_gives_a_row_the_same_bits_alone_in_any_batch_and_at_any_thread_count(k, n):
    """engine.batch_invariant in bf16 (PackedLinear.make_batch_invariant): the weight read back from oneDNN's packing
    and repacked for the tiles, every row count on the tile path, the threads splitting only the columns."""
    from batchgen.models.packed_linear import PackedLinear

    w, x, b, expected = case(130, k, n, True)
    linear = PackedLinear(w, b)
    linear.make_batch_invariant()
    assert linear.kernel == "amx" and not linear.packed_weight.is_mkldnn
    assert torch.equal(linear.packed_weight, torch.ops.batchgen.linear_amx_pack(w))  # to_dense: the weight bit for bit
    before = torch.get_num_threads()
    try:
        outs = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs[threads] = [linear(x[0])[None]] + [linear(x[:rows]) for rows in (7, 33, 130)]
    finally:
        torch.set_num_threads(before)
    reference = outs[1][-1]
    assert_bf16_close(reference, expected)
    for threads, results in outs.items():
        for out in results:
            assert torch.equal(out, reference[:out.shape[0]]), f"{out.shape[0]} rows at {threads} thread(s)"


def test_without_the_amx_linear_a_batch_invariant_packed_linear_stays_on_onednn(monkeypatch):
    """BATCHGEN_NO_AMX, or a build that fails: oneDNN's calls of a fixed row count, as before the AMX Linear."""
    from batchgen.models import packed_linear

    monkeypatch.setattr(packed_linear, "_amx_linear_loads", lambda: False)
    w, x, b, expected = case(20, 96, 48, True)
    linear = packed_linear.PackedLinear(w, b)
    linear.make_batch_invariant(packed_linear.AMX_INVARIANT_ROWS_PREFILL)
    assert linear.kernel == "onednn" and linear.packed_weight.is_mkldnn
    assert linear.invariant_rows == packed_linear.AMX_INVARIANT_ROWS_PREFILL
    assert_bf16_close(linear(x), expected)
