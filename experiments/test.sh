#!/usr/bin/env bash
# The lab's tests (experiments/tests): the experiments' scripts on reduced runs, the pages' tables against their
# evidence files. The library's tests are the README's command, `bash scripts/test.sh`; this one reuses its .venv.
#   bash experiments/test.sh          # every lab test but those on a real vLLM engine (a few minutes)
#   bash experiments/test.sh --vllm   # those on a real vLLM engine (CPU build), in .venv-vllm
# Extra arguments go to pytest, e.g. `bash experiments/test.sh -k page_tables`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--vllm" ]; then
  shift
  exec bash scripts/test.sh --vllm experiments/tests -m vllm "$@"
fi
exec bash scripts/test.sh experiments/tests -m "not vllm" "$@"
