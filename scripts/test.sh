#!/usr/bin/env bash
# Sets up batchgen, then runs the whole test suite (CPU; Triton kernels through its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec $PY -m pytest -q "$@"
