"""The C++ CPU kernels as an AVX2-only machine builds them (BATCHGEN_CPU_MARCH=x86-64-v3: no AVX-512), built in a
subprocess into its own cache and run through the kernel tests. This machine may have AVX-512; CI machines may not: code that only
compiles with AVX-512 (an asm constraint, an intrinsic) would otherwise reach AVX2 machines untested, where a failed
build silently falls back to the slow torch ops. Built this way the attention kernels are correct but slower than
torch's (their 16-lane vectors are split and spilled), so `auto` must keep the torch reference there."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, pytest
from batchgen_kernels import cpu_build
assert "-march=x86-64-v3" in cpu_build.FLAGS
if not cpu_build.load():
    sys.exit("the AVX2 build failed (its compiler error is in the warning above)")
import torch
from batchgen_kernels import get_backend, reference
assert not torch.ops.batchgen.wide_vectors(), "an AVX2 build claims AVX-512 vectors"
assert get_backend("cpu", "auto") is reference, "auto took the C++ attention kernels built for AVX2 (slower than torch)"
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "tests/test_cpu_prefill.py", "tests/test_cpu_attention.py",
                      "tests/test_fused_ops.py", "-k", "not engine and not built_once and not without_a_compiler "
                      "and not library_key"]))
"""


def _has_avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\\n", " ")
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx2(), reason="needs an x86-64 CPU with AVX2 to run what it builds")
def test_kernels_built_for_avx2_pass_the_kernel_tests(tmp_path):
    env = {**os.environ, "BATCHGEN_CACHE_DIR": str(tmp_path), "BATCHGEN_CPU_MARCH": "x86-64-v3",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels"), str(ROOT / "tests")])}
    env.pop("BATCHGEN_NO_CPU_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert " passed" in result.stdout
    libraries = list(tmp_path.glob("kernels/*/batchgen_cpu_kernels.so"))
    assert len(libraries) == 1
    disassembly = subprocess.run(["objdump", "-d", str(libraries[0])], capture_output=True, text=True)
    if disassembly.returncode == 0:  # objdump present: the library really is AVX-512-free
        assert "zmm" not in disassembly.stdout
