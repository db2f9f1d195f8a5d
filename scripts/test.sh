#!/usr/bin/env bash
# The test command: sets up the environment if needed, then runs pytest. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh                # the linter and formatter (ruff), the type checker (mypy), then the default run
#                                       # (slow tests left out; vLLM tests skip without vLLM), on two workers
#                                       # (TOPR_TEST_WORKERS)
#   bash scripts/test.sh -m slow        # the multi-process and DeepSpeed tests (minutes)
#   bash scripts/test.sh --vllm         # the tests on a real vLLM engine (CPU build), in .venv-vllm, slow ones
#                                       # left out
#   bash scripts/test.sh --vllm -m "vllm and slow"   # those on the real model (minutes each; not in CI)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--vllm" ]; then
  shift
  bash scripts/bootstrap.sh --vllm
  venv="${TOPR_VENV:-.venv-vllm}"
  if [ "$#" -eq 0 ]; then set -- -m "vllm and not slow"; fi
  # the engines' KV cache on a CPU (GiB; vLLM's default is 4 per engine)
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
else
  bash scripts/bootstrap.sh
  venv="${TOPR_VENV:-.venv}"
  if [ "$#" -eq 0 ]; then
    # the linter and the formatter first, on everything they cover (pyproject.toml): a second of work, and CI's first
    # failure to read; then the type checker on the library's core (pyproject.toml's [tool.mypy])
    "$venv/bin/python" -m ruff check --quiet . || { echo "[test] ruff check failed: fix the lines above" >&2; exit 1; }
    "$venv/bin/python" -m ruff format --check --quiet . \
      || { echo "[test] ruff format --check failed: run \`.venv/bin/ruff format .\`" >&2; exit 1; }
    "$venv/bin/python" -m mypy || { echo "[test] mypy failed: fix the lines above" >&2; exit 1; }
    # two workers (pytest-xdist), a test file to each in turn: the default run is mostly processes started and
    # waited for, and takes about 0.6 of one worker's time on CI's two cores
    set -- -m "not slow" -n "${TOPR_TEST_WORKERS:-2}" --dist loadfile
  fi
fi
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
exec "$venv/bin/python" -m pytest -q "$@"
