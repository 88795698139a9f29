import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_package_does_not_shadow_pypi_kernels():
    """transformers probes for the unrelated PyPI package `kernels` at import; ours imports as `batchgen_kernels`,
    and running from the repository root (where kernels/ sits on sys.path) must not make it look installed."""
    code = ("import importlib.util, transformers, batchgen_kernels\n"
            "from transformers.utils import is_kernels_available\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "assert spec is None or spec.origin in (None, 'namespace'), spec\n"
            "assert not is_kernels_available()\n"
            "print(batchgen_kernels.get_backend('cpu').__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("batchgen_kernels.cpu_backend", "batchgen_kernels.reference")
