import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_our_kernels_and_pypi_kernels_stay_apart():
    """Ours import as `batchgen_kernels`; `kernels` is an unrelated PyPI package (hub kernels) that transformers
    probes for, and from 5.25 on requires. Run from the repository root (where kernels/ sits on sys.path): where the
    PyPI package is installed, `kernels` is it and not our folder; where it is not, our folder does not make it look
    installed. Either way a transformers model (the reference batchgen's tests compare against) runs transformers'
    own forward code: no hub kernel is swapped in unless asked for (`kernelize`, `use_kernels=True`), which batchgen
    never does."""
    code = ("import importlib.util, transformers, torch, batchgen_kernels\n"
            "from pathlib import Path\n"
            "from transformers import AutoConfig, AutoModelForCausalLM\n"
            "from transformers.utils import is_kernels_available\n"
            "root = Path.cwd().resolve()\n"
            "assert root / 'kernels' in Path(batchgen_kernels.__file__).resolve().parents, batchgen_kernels.__file__\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "if is_kernels_available():\n"
            "    import kernels\n"
            "    assert kernels.__file__ and root not in Path(kernels.__file__).resolve().parents, kernels.__file__\n"
            "else:\n"
            "    assert spec is None or spec.origin in (None, 'namespace'), spec\n"
            "config = AutoConfig.for_model('llama', hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
            "                              num_attention_heads=4, num_key_value_heads=2, vocab_size=256)\n"
            "model = AutoModelForCausalLM.from_config(config)\n"
            "assert not getattr(model, '_use_kernels', False)\n"
            "for module in model.modules():\n"
            "    assert 'forward' not in vars(module), type(module)\n"
            "    assert type(module).forward.__module__.startswith(('transformers.', 'torch.')), type(module)\n"
            "model(torch.tensor([[1, 2, 3]]))\n"
            "print(is_kernels_available(), batchgen_kernels.get_backend('cpu').__name__)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=env)  # may build the C++ kernels
    assert out.returncode == 0, out.stderr
    available, backend = out.stdout.split()[-2:]
    assert backend in ("batchgen_kernels.cpu_backend", "batchgen_kernels.reference")
    import transformers
    from packaging.version import Version
    if Version(transformers.__version__) >= Version("5.25"):  # it requires the package from then on
        assert available == "True"


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


def test_version_names_the_libraries_a_job_runs_with():
    """`batchgen --version`: batchgen's version, then the installed version of each library that shapes results."""
    from importlib import metadata

    import batchgen

    out = subprocess.run([sys.executable, "-m", "batchgen", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"batchgen {batchgen.__version__}"
    shown = dict(line.split() for line in lines[1:])
    for library in ("torch", "transformers", "tokenizers", "xgrammar"):
        assert shown[library] == metadata.version(library)
