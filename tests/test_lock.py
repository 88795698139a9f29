"""requirements-lock.txt is what CI tested: scripts/setup.sh installs exactly it (hashes checked), and it agrees
with pyproject.toml's ranges, so `pip install -e .` unpinned and the lock describe the same package."""
import os
import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements-lock.txt"


def locked() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) from the lock's `name==version \\ --hash=...` entries."""
    found: dict[str, tuple[str, list[str]]] = {}
    for entry in re.split(r"\n(?=[A-Za-z0-9])", LOCK.read_text()):
        head = re.match(r"([A-Za-z0-9._-]+)==([^\s\\;]+)", entry)
        if head:
            found[canonicalize_name(head[1])] = (head[2], re.findall(r"--hash=sha256:([0-9a-f]{64})", entry))
    return found


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [req for reqs in project["optional-dependencies"].values() for req in reqs]
    return [Requirement(req) for req in project["dependencies"] + extras]


def test_every_locked_package_has_its_hashes_and_every_dependency_is_locked():
    lock = locked()
    assert len(lock) > 50
    assert all(hashes for _, hashes in lock.values()), [n for n, (_, h) in lock.items() if not h]
    for req in declared():
        name = canonicalize_name(req.name)
        if name == "torch":  # pinned apart, in scripts/setup.sh
            continue
        assert name in lock, f"{req} is not in requirements-lock.txt: run dev/lock.sh"
        assert req.specifier.contains(lock[name][0], prereleases=True), f"the lock's {name} {lock[name][0]} is not {req}"


def test_torch_pinned_by_setup_is_within_pyproject_range():
    pinned = re.search(r"^TORCH_VERSION=(\S+)$", (ROOT / "scripts/setup.sh").read_text(), re.M)[1]
    [torch] = [req for req in declared() if req.name == "torch"]
    assert torch.specifier.contains(pinned)


@pytest.mark.skipif(os.environ.get("BATCHGEN_UNLOCKED") == "1", reason="dev/try_versions.sh: not the locked versions")
def test_the_environment_holds_exactly_the_locked_versions():
    """What scripts/setup.sh installed (CI runs this after it): every locked package at its locked version."""
    wrong = {}
    for name, (version, _) in locked().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[name] = (installed, version)
    assert not wrong, f"installed vs locked: {wrong}; run scripts/setup.sh"
