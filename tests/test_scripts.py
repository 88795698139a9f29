"""scripts/ holds the README's commands and nothing else; dev/ the developers' commands, each in dev/README.md's
index (what it measures, the figure in docs/ it backs). Every Python one under dev/ still starts: its imports resolve
and it parses --help (a refactor that moves a function they import otherwise goes unnoticed until someone reruns a
measurement)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "dev"
HELPERS = {"lock_filter.py", "lock_diff.py"}  # dev/lock.sh's and dev/try_versions.sh's helpers: no --help
COMMANDS = sorted(path for path in DEV.glob("*.py") if path.name not in HELPERS)


def test_scripts_holds_only_what_the_readme_tells_a_user_to_run():
    named = set(re.findall(r"\bscripts/([\w.-]+)", (ROOT / "README.md").read_text()))
    assert sorted(path.name for path in (ROOT / "scripts").iterdir()) == sorted(named)


def test_every_dev_command_is_in_the_index():
    index = set(re.findall(r"`dev/([\w.-]+)", (DEV / "README.md").read_text()))
    assert sorted(path.name for path in DEV.iterdir() if path.name != "README.md") == sorted(index)


@pytest.mark.parametrize("script", COMMANDS, ids=lambda path: path.name)
def test_dev_command_starts(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in (result.stdout + result.stderr).lower()
