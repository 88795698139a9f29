#!/usr/bin/env bash
# Sets up batchgen, then runs the whole test suite (CPU; Triton kernels through its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Headless Chromium (Debian's) renders the job report in tests/test_report.py; installed where the machine allows.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
    || echo "scripts/test.sh: could not install chromium; the report tests will say so" >&2
fi
PY=${PYTHON:-python3}
# Two pytest-xdist workers, each running a whole file at a time (a module's fixtures are built once); tests/conftest.py
# gives each worker, and the processes its tests start, half the cores.
# --durations: the slowest tests in every log, to keep the suite under its time budget.
exec $PY -m pytest -q -n 2 --dist loadfile --durations=25 "$@"
