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
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)  # may build the C++ kernels
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("batchgen_kernels.cpu_backend", "batchgen_kernels.reference")


def test_the_wheel_holds_every_module(tmp_path):
    """A non-editable install gets only what the wheel holds: every module under batchgen/ and the kernels' sources
    (a sub-package missing from pyproject's package list installs without it and fails at import)."""
    import shutil
    import zipfile

    # Built from a copy of the tree's files (tracked, or new and not ignored): a build/ folder left by an earlier
    # build would otherwise hand the wheel modules the package list no longer names.
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    source = tmp_path / "source"
    for name in listed:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("batchgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {str(path.relative_to(ROOT)) for path in (ROOT / "batchgen").rglob("*.py")}
    kernels = ROOT / "kernels"
    wanted |= {str(path.relative_to(kernels)) for path in (kernels / "batchgen_kernels").rglob("*")
               if path.suffix in (".py", ".cpp", ".h")}
    assert not wanted - names, f"missing from the wheel: {sorted(wanted - names)}"
