#!/usr/bin/env bash
# The main job: sets up the repository's .venv if needed, then runs `topr-trl train` with the arguments given (the
# README runs `--task reasoning`, the reasoning testbed; with no arguments, the quick built-in arithmetic task).
# It runs in the folder it is called from: relative paths (--dataset_name, --reward_funcs module:function,
# --output_dir, the default outputs/ folder) are the caller's, as for any command.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/bootstrap.sh"
venv="${TOPR_VENV:-.venv}"
case "$venv" in /*) ;; *) venv="$repo/$venv" ;; esac
export HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
# the command an interrupted run prints to resume it is this script, as its user can paste it
export TOPR_TRL_LAUNCHER="bash $(printf %q "$repo/scripts/train.sh")"
exec "$venv/bin/topr-trl" train "$@"
