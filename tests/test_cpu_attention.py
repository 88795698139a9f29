"""The C++ CPU decode kernel (the `cpu` attention backend) against the torch reference, its build cache and fallback,
and the engine's greedy output on it. Skipped as a whole where the kernel cannot be built (no compiler)."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention_cases import (WINDOWS, TOLERANCE, assert_close, forget_blocks_before_windows, make_case,
                             poison_unused_slots, window_decode_lens)
from batchgen_kernels import AttentionMetadata, amx, cpu_backend, cpu_build, get_backend, reference

if not cpu_backend.available():
    pytest.skip("the C++ CPU kernels cannot be built here (see the warning logged by batchgen_kernels.cpu_build)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


def decode_both(q, k_cache, v_cache, md, scale, window=None):
    """The kernel on caches poisoned outside the contexts (and before the windows), and the reference on the clean
    ones."""
    k_poisoned, v_poisoned = (poison_unused_slots(cache, md, window) for cache in (k_cache, v_cache))
    got = cpu_backend.paged_attention(q, k_poisoned, v_poisoned, md, scale, window)
    return got, reference.paged_attention(q, k_cache, v_cache, md, scale, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_decode_matches_reference(dtype, block_size, group, head_dim):
    # Contexts of one token, a block less one, exactly one block, one past a block, several blocks, and one long
    # enough for many of the kernel's 32-token tiles (which are smaller and larger than these blocks).
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 300]
    q, k_cache, v_cache, md = make_case([1] * 6, seq_lens, block_size=block_size, group=group, head_dim=head_dim,
                                        dtype=dtype, seed=block_size + group)
    got, expected = decode_both(q, k_cache, v_cache, md, head_dim ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32, 48, 72, 96, 256])
def test_every_head_dim_path(dtype, head_dim):
    """The kernel's paths by head_dim: vector code for multiples of 16 (bf16 dot products on an even count of
    16-float chunks where the CPU has them, widened bf16 otherwise), a plain loop for the rest (72) and for fp16
    caches; query heads in value micro-kernels of up to 4 rows (group 5 = 4 + 1, or 2 + 2 + 1 at larger dims)."""
    q, k_cache, v_cache, md = make_case([1] * 4, [1, 15, 17, 130], block_size=16, num_kv_heads=2, group=5,
                                        head_dim=head_dim, dtype=dtype, seed=head_dim)
    got, expected = decode_both(q, k_cache, v_cache, md, head_dim ** -0.5)
    assert got.dtype == dtype
    assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_decode_matches_reference(dtype, block_size, group, head_dim, window):
    """Contexts shorter than, equal to and far longer than the window (a window off the blocks' and tiles' edges),
    the vector path (64) and the plain one (72); every slot before a window is NaN, so one read of it shows."""
    q, k_cache, v_cache, md = make_case([1] * 6, window_decode_lens(window), block_size=block_size, group=group,
                                        head_dim=head_dim, dtype=dtype, seed=window + group)
    got, expected = decode_both(q, k_cache, v_cache, md, head_dim ** -0.5, window)
    assert torch.isfinite(got).all()
    assert_close(got, expected)


def test_sliding_window_decode_skips_the_blocks_before_it():
    """The blocks wholly before the window are not even looked up (block-table entries of -1 pass the checks), and a
    window no shorter than any context changes nothing, bit for bit."""
    q, k_cache, v_cache, md = make_case([1] * 3, [30, 300, 5000], block_size=16, group=3, head_dim=64, seed=9)
    forgotten = forget_blocks_before_windows(md, 40, 16)
    assert (forgotten.block_tables == -1).sum() == 260 // 16 + 4960 // 16
    got, _ = decode_both(q, k_cache, v_cache, forgotten, 0.125, 40)
    assert_close(got, reference.paged_attention(q, k_cache, v_cache, md, 0.125, 40))
    full = cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.125)
    assert torch.equal(cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.125, 5000), full)
    with pytest.raises(ValueError, match="at least 1"):
        cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.125, 0)


def test_head_dim_128_with_one_kv_head_and_large_scores():
    # A large scale makes the softmax peaky: the running max must move many times without losing precision.
    q, k_cache, v_cache, md = make_case([1, 1], [40, 500], block_size=32, num_kv_heads=1, group=8, head_dim=128)
    got, expected = decode_both(q, k_cache, v_cache, md, 1.0)
    assert_close(got, expected)


def test_fp32_query_over_a_bf16_cache_and_a_strided_query():
    """q as the model hands it over (a view into the fused QKV projection, rows not contiguous), in fp32 over a
    bf16 cache: the output is fp32, like q."""
    q, k_cache, v_cache, md = make_case([1] * 3, [7, 33, 90], num_kv_heads=2, group=3, head_dim=64,
                                        dtype=torch.bfloat16)
    fused = torch.randn(3, 3 * q.shape[1] * 64)
    q32 = fused[:, : q.shape[1] * 64].view(3, q.shape[1], 64)
    assert not q32.is_contiguous()
    got = cpu_backend.paged_decode(q32, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125)
    expected = reference.paged_decode(q32, k_cache, v_cache, md.block_tables, md.seq_lens, md.max_seq_len, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 72])
def test_decode_over_a_head_major_cache(dtype, head_dim):
    """The caches as a view of [N, Hkv, bs, D] memory (what dev/microbench_attention.py cpu-stream compares):
    the kernel follows the strides, on the vector path (64) and the plain one (72)."""
    q, k_cache, v_cache, md = make_case([1] * 3, [5, 16, 77], block_size=16, num_kv_heads=3, group=3,
                                        head_dim=head_dim, dtype=dtype)
    k_heads, v_heads = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
    assert not k_heads.is_contiguous() and torch.equal(k_heads, k_cache)
    got = cpu_backend.paged_decode(q, k_heads, v_heads, md.block_tables, md.seq_lens, 0.125)
    assert_close(got, reference.paged_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.max_seq_len,
                                             0.125))
    with pytest.raises(RuntimeError, match="head_dim contiguous"):
        cpu_backend.paged_decode(q, k_cache[..., ::2], v_cache[..., ::2], md.block_tables, md.seq_lens, 0.125)


def test_an_empty_context_gives_zeros():
    """A zero-length row (batch padding) gives zeros, not NaN, and leaves the other rows alone."""
    q, k_cache, v_cache, md = make_case([1, 1], [70, 70], group=3, head_dim=64)
    seq_lens = torch.tensor([70, 0], dtype=torch.int32)
    out = cpu_backend.paged_decode(q, k_cache, v_cache, md.block_tables, seq_lens, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[:1], reference.paged_decode(q[:1], k_cache, v_cache, md.block_tables[:1], seq_lens[:1], 70,
                                                 0.125))


def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    q, k_cache, v_cache, md = make_case([1, 1], [20, 40], group=3, head_dim=64)
    too_long = torch.tensor([20, 40 + 16 * md.block_tables.shape[1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        cpu_backend.paged_decode(q, k_cache, v_cache, md.block_tables, too_long, 0.125)
    bad_table = md.block_tables.clone()
    bad_table[1, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_backend.paged_decode(q, k_cache, v_cache, bad_table, md.seq_lens, 0.125)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_stores_then_attends_like_the_reference(block_size, dtype):
    """What one layer does in a step mixing decodes with prefills, some of them after a cached prefix."""
    query_lens = [1, 1, 1, 19, 5, 2 * block_size]
    seq_lens = [2, block_size + 1, 70, 19, 5 + block_size, 2 * block_size + 9]
    q, k_cache, v_cache, md = make_case(query_lens, seq_lens, block_size=block_size, group=3, head_dim=80,
                                        dtype=dtype, seed=3)
    key = torch.randn(q.shape[0], k_cache.shape[2], k_cache.shape[3]).to(dtype)
    value = torch.randn_like(key)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, k_ref, v_ref, md.slot_mapping)
    expected = reference.paged_attention(q, k_ref, v_ref, md, 80 ** -0.5)
    cpu_backend.store_kv(key, value, k_cache, v_cache, md.slot_mapping)
    out = cpu_backend.paged_attention(q, k_cache, v_cache, md, 80 ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, expected)


def test_the_comparison_catches_a_wrong_block_or_context():
    """The tolerances have teeth: one block read from the wrong place, or one token less of context, changes the
    output of every sequence."""
    q, k_cache, v_cache, md = make_case([1, 1, 1], [40, 70, 33], block_size=16)
    expected = reference.paged_attention(q, k_cache, v_cache, md, 0.1)
    unused = sorted(set(range(k_cache.shape[0])) - set(md.block_tables.flatten().tolist()))[0]
    redirected = md.block_tables.clone()
    redirected[:, 1] = unused  # every sequence here has at least two blocks
    for wrong in (AttentionMetadata(**{**md.__dict__, "block_tables": redirected}),
                  AttentionMetadata(**{**md.__dict__, "seq_lens": md.seq_lens - 1})):
        out = cpu_backend.paged_attention(q, k_cache, v_cache, wrong, 0.1)
        for row in range(3):
            assert not torch.allclose(out[row], expected[row], **TOLERANCE[torch.float32])


def test_fake_implementation_traces_without_running_the_kernel():
    """What torch.compile sees: the op's output shape and dtype from fake tensors, and opcheck's consistency."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k_cache, v_cache, md = make_case([1, 1], [20, 40], group=3, head_dim=64, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (q, k_cache, v_cache, md.block_tables, md.seq_lens)]
        out = torch.ops.batchgen.paged_decode(*fake, 0.125, -1)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.library.opcheck(torch.ops.batchgen.paged_decode.default,
                          (q, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, 16),
                          test_utils=("test_schema", "test_faketensor"))


def test_backend_choice():
    """auto takes the C++ kernels where they were built for AVX-512 (tests/test_cpu_kernels_avx2.py checks the
    other side: built for AVX2, auto keeps the torch reference); an explicit `cpu` takes them wherever they build."""
    assert get_backend("cpu", "auto") is (cpu_backend if cpu_backend.preferred() else reference)
    assert get_backend("cpu", "cpu") is cpu_backend
    assert get_backend("cpu", "torch") is reference
    with pytest.raises(ValueError, match="CPU tensors"):
        get_backend("cuda", "cpu")


def test_library_key_covers_source_torch_flags_and_cpu(monkeypatch, tmp_path):
    compiler = cpu_build._compiler()
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    base = cpu_build.library_path(compiler)
    assert base.parent.parent == tmp_path / "kernels"
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "avx2 fma")  # an AVX2-only machine
    assert cpu_build.library_path(compiler) != base
    monkeypatch.undo()
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "FLAGS", cpu_build.FLAGS + ["-DSOMETHING"])
    assert cpu_build.library_path(compiler) != base
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert cpu_build.library_path(compiler) != base


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_without_a_compiler_the_reference_is_used_after_one_warning(tmp_path):
    code = ("import logging; logging.basicConfig()\n"
            "from batchgen_kernels import get_backend\n"
            "print(get_backend('cpu', 'auto').__name__, get_backend('cpu', 'cpu').__name__)\n")
    out = run_python(code, CXX=str(tmp_path / "no-such-compiler"), BATCHGEN_CACHE_DIR=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["batchgen_kernels.reference"] * 2
    assert out.stderr.count("WARNING") == 1 and "no C++ compiler" in out.stderr


def test_the_library_is_built_once_then_loaded_from_the_cache(tmp_path):
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from batchgen_kernels import cpu_build\n"
            "assert cpu_build.load()\n")
    first = run_python(code, BATCHGEN_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0 and "CPU kernels: built" in first.stderr, first.stderr
    second = run_python(code, BATCHGEN_CACHE_DIR=str(tmp_path))
    assert second.returncode == 0 and "built" not in second.stderr, second.stderr
    assert len(list((tmp_path / "kernels").glob("*/*.so"))) == 1


def test_the_source_ships_with_the_package():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = ROOT / "kernels" / "batchgen_kernels"
    sources = sorted(path for path in package.glob("csrc/**/*") if path.is_file())
    assert cpu_build.SOURCES == [s for s in sources if s.suffix == ".cpp" and s.parent.name == "csrc"]
    assert sorted(amx.SPEC.sources + amx.LINEAR.sources) == [s for s in sources
                                                            if s.suffix == ".cpp" and s.parent.name == "amx"]
    assert all(any(s.match(f"*/{pattern}") for pattern in patterns["batchgen_kernels"]) for s in sources)


# ------------------------------------------------------------------------------------------------ in the engine

@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_engine_greedy_output_equals_the_torch_backend(request, model_fixture, caplog):
    from test_engine import greedy, make_engine, random_prompts, run

    model_dir = request.getfixturevalue(model_fixture)
    prompts = random_prompts(0, 12, 384) + random_prompts(1, 6, 384, shared_prefix=40)
    outputs = {}
    for backend in ("torch", "cpu"):
        engine = make_engine(model_dir, attention_backend=backend, max_num_seqs=8, max_num_batched_tokens=128)
        assert engine.model.model.layers[0].self_attn.attn.backend is (reference if backend == "torch" else
                                                                      cpu_backend)
        outputs[backend] = [r.token_ids for r in run(engine, prompts, greedy(40))]
    assert outputs["cpu"] == outputs["torch"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

