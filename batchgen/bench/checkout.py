"""The batchgen checkout this process runs from, if any: the current directory, when the batchgen imported here is
that directory's own batchgen/ (`PYTHONPATH=.:kernels python -m batchgen.bench ...` in a checkout's root, or an
editable install run there). Only then does the bench record the commit (git runs in that checkout, never in an
installed package's directory) and the GPU check run the checkout's test suite (its step 1). An installed batchgen
looks for no checkout: nothing here climbs from a module's own file to the directories around it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

NOT_A_CHECKOUT = ("not run from a batchgen checkout (the current directory's batchgen/ is not the one imported "
                  "here, or there is none)")


def checkout_root() -> Path | None:
    """The current directory, when this very file is its batchgen/bench/checkout.py; else None."""
    here = Path.cwd()
    try:
        ours = os.path.samefile(here / "batchgen" / "bench" / "checkout.py", __file__)
    except OSError:  # no batchgen/ in the current directory
        return None
    return here if ours and (here / "pyproject.toml").is_file() else None


def git_commit() -> str | None:
    """HEAD of the checkout batchgen runs from; None outside one (an installed batchgen: no git is run) or where git
    cannot tell."""
    root = checkout_root()
    if root is None:
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None
