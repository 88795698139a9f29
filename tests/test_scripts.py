"""Every script under scripts/ that docs cite for a figure still starts: its imports resolve and it parses --help.
(A refactor that moves a function they import otherwise goes unnoticed until someone reruns a measurement.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_script_starts(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels")])}
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in (result.stdout + result.stderr).lower()
