#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs pytest. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m slow        # the multi-process and DeepSpeed tests (minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
exec "${TOPR_VENV:-.venv}/bin/python" -m pytest -q "$@"
