#!/usr/bin/env bash
# Sets up batchgen, then runs the whole test suite (CPU; Triton kernels through its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
# Two pytest-xdist workers, each running a whole file at a time (a module's fixtures are built once); tests/conftest.py
# gives each worker, and the processes its tests start, half the cores.
exec $PY -m pytest -q -n 2 --dist loadfile "$@"
