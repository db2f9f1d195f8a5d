#!/usr/bin/env bash
# The main job: sets up .venv if needed, then runs `topr-trl train` with the arguments given (the README runs
# `--task reasoning`, the reasoning testbed; with no arguments, the quick built-in arithmetic task).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
exec "${TOPR_VENV:-.venv}/bin/topr-trl" train "$@"
