#!/usr/bin/env bash
# The GPU run that measures what pi on mu's support costs at the Qwen2.5-0.5B shape (experiments/benchmarks.md), as one
# command that fits a short lease on a machine without a package index.
#
#   bash experiments/gpu_support.sh wheels              # here: trl and datasets (and datasets' dill and multiprocess,
#                                                       # which GPU images lack) as Python 3.12 wheels in .whl/
#   bash experiments/gpu_support.sh run OUT             # there: installs .whl/ into /tmp/site where trl or datasets
#                                                       # is missing, then writes at most 7 files to OUT
#   bash experiments/gpu_support.sh run OUT --smoke --device cpu   # the same steps on tiny shapes, on a CPU
#
# Each step runs under its own time limit, so that what finished is kept when a later step does not:
#   versions.txt                   versions, the GPU's name and its bf16 matrix-product rate;
#   support-rule.json              the rule alone per 1,000 tokens at the 151,936-token vocabulary, flat and peaked
#                                  rows, top-k 50 and top-p 0.95, against the whole-vocabulary log-softmax
#                                  (`experiments.benchmark --support_only`);
#   support-loss-scale{4,1,8}.json loss + backward and the memory a call adds, top-k 50 and top-p 0.95 against TOPR
#                                  untruncated and GRPO on the same batch (`experiments.benchmark --loss_only`), the
#                                  logits scaled 4x (rows between flat and peaked), 1x (random weights: flat) and 8x;
#   shared-prompt.json             TOPRTrainer with topr_shared_prompt_forward against GRPOTrainer (dapo) on the
#                                  word problems' two-shot prompts, 8 and 4 completions a prompt: loss + backward,
#                                  whole steps, the memory a call adds (`experiments.benchmark --shared_prompt`);
#   log.txt                        the whole output.
# Planned at about five minutes on an H100, model builds included (not yet run on one); the steps' limits add up to
# under nine.
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: $0 wheels | run OUT [--smoke] [--device cpu|cuda]"
case "${1:-}" in
  wheels)
    cd "$here" || exit 1
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 || exit 1
    ls -l .whl
    exit 0 ;;
  run) ;;
  *) echo "$usage" >&2; exit 2 ;;
esac

out=${2:?$usage}
shift 2
smoke=0
device=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --device) device=${2:?$usage}; shift ;;
    *) echo "unknown option $1; $usage" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)
cd "$here" || exit 1
exec > >(tee "$out/log.txt") 2>&1

python=${PYTHON:-python3}
if ! "$python" -c "import datasets, trl" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the wheels in .whl/ did not install"; exit 1; }
  export PYTHONPATH=/tmp/site:$here${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 PYTHONUNBUFFERED=1

precision=(--bf16)
loss_shape=(--model qwen2.5-0.5b --prompt_length 512 --completion_length 512 --repeats 1 --steps 12)
rule_shape=(--batch_size 4 --completion_length 512 --repeats 6)
rule_limit=60  # seconds a step may take: with the versions (30 s), 450 s in all
loss_limit=120
if [ "$smoke" = 1 ]; then
  precision=()
  loss_shape=(--smoke --model tiny)
  rule_shape=(--batch_size 2 --completion_length 8 --repeats 2)
  rule_limit=300
  loss_limit=300
fi
failed=0
step() {  # step NAME SECONDS COMMAND...: run under a time limit; a failure is noted and the next step runs
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit $limit s)"
  local start=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - start)) s"
  [ "$rc" = 0 ] || failed=1
}
loss_backward() {  # loss_backward SCALE (the smoke's tiny model takes no logit scale)
  local scaled=(--logit_scale "$1")
  [ "$smoke" = 1 ] && scaled=()
  step "loss + backward, scale $1" "$loss_limit" "$python" -m experiments.benchmark --device "$device" \
    "${precision[@]}" "${scaled[@]}" "${loss_shape[@]}" --loss_only --output "$out/support-loss-scale$1.json"
}

step versions 30 "$python" -c '
import sys, time
import datasets, torch, transformers, trl
device, path = sys.argv[1:]
lines = [f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
         f"datasets {datasets.__version__}"]
if device == "cuda":
    lines.append(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    lines.append(f"bf16 matrix product {10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12:.0f} TFLOP/s")
print("\n".join(lines))
open(path, "w").write("\n".join(lines) + "\n")
' "$device" "$out/versions.txt"
step "the rule alone" "$rule_limit" "$python" -m experiments.benchmark --device "$device" --support_only \
  "${rule_shape[@]}" --output "$out/support-rule.json"
loss_backward 4
loss_backward 1
loss_backward 8
shared_shape=(--model qwen2.5-0.5b --batch_size 8 --completion_length 64 --repeats 5 --steps 4 --step_rounds 1)
[ "$smoke" = 1 ] && shared_shape=(--model tiny --batch_size 8 --completion_length 8 --repeats 1 --warmup 0 --steps 2 \
  --step_rounds 1)
step "shared prompt" "$((2 * loss_limit))" "$python" -m experiments.benchmark --device "$device" "${precision[@]}" \
  --shared_prompt "${shared_shape[@]}" --output "$out/shared-prompt.json"
echo "== done: $([ "$failed" = 0 ] && echo 'every step passed' || echo 'a step failed (above)')"
exit "$failed"
