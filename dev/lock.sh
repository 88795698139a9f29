#!/usr/bin/env bash
# Writes requirements-lock.txt: the exact version, with every file's hash, of each package that scripts/setup.sh and
# CI install (batchgen's dependencies and all of its extras). Versions already in the lock are kept where they still
# fit pyproject.toml; UPGRADE=1 resolves everything anew from today's index. Run it on purpose (after
# `dev/try_versions.sh newest` says the newest versions pass), then commit the lock with the fixes it needed.
# torch is pinned apart (scripts/setup.sh): pip takes the CPU build from the machine's disk where it lies there, and
# the CUDA build's nvidia-*/cuda-* libraries are left to torch's own install.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=$(sed -n 's/^TORCH_VERSION=//p' scripts/setup.sh)
EXTRAS=$(python3 -c "import tomllib; print(' '.join('--extra ' + e for e in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']))")
python3 -m pip install -q uv
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "torch==$TORCH" > "$tmp/torch.txt"
# uv takes the versions in an existing output file as its preferences.
[ "${UPGRADE:-0}" = 1 ] || [ ! -f requirements-lock.txt ] || cp requirements-lock.txt "$tmp/all.txt"
# shellcheck disable=SC2086
python3 -m uv pip compile pyproject.toml $EXTRAS -c "$tmp/torch.txt" --python-version 3.11 \
  --python-platform x86_64-manylinux_2_28 --generate-hashes --no-header --quiet -o "$tmp/all.txt"
python3 dev/lock_filter.py "$tmp/all.txt" > requirements-lock.txt
echo "requirements-lock.txt: $(grep -c '^[a-z0-9]' requirements-lock.txt) packages"
