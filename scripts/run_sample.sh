#!/usr/bin/env bash
# Sets up batchgen, then runs the sample job: data/samples/prompts.parquet -> out/sample/
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
batchgen run jobs/sample.yaml "$@"
