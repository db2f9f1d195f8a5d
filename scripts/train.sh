#!/usr/bin/env bash
# The main job: sets up .venv if needed, then runs `topr-trl train`. With no arguments it trains a tiny
# model built locally on the built-in arithmetic task (CPU, under a minute after the install). Arguments go to `topr-trl train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
exec "${TOPR_VENV:-.venv}/bin/topr-trl" train "$@"
