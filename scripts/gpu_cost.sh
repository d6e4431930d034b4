#!/usr/bin/env bash
# Issue 55 on one GPU (device tool, 1 GPU, <= 8 minutes by its timeouts, ~5 expected): the healthy-step overhead of the Guard on a short step and on
# the synchronous path, and the CLI start-up / replay's first step. Interleaved rounds (scripts/bench/step_ratios.py),
# each figure beside its baseline from the same run. Logs under OUT/<step>.log, one line each in OUT/summary.txt.
# Usage (repo root, .whl carried: forensics' dependencies): bash scripts/gpu_cost.sh "$OUT"   (ROUNDS=8 STEPS=10 BATCH=6)
set -uo pipefail
out=${1:-/tmp/gpu_cost}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
rounds=${ROUNDS:-8} steps=${STEPS:-10} batch=${BATCH:-6}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/card.txt" 2>&1
failed=0
run() {  # run NAME SECONDS CMD...: CMD's output in OUT/NAME.log, its table lines in the summary
  local name=$1 limit=$2; shift 2
  local start=$SECONDS code=0
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || code=$?
  { echo "== $name (exit $code, $((SECONDS - start)) s): $*"
    grep -E "^(machine|config|mode|plain|guarded|synchronous|ratio|\| )|inside the Guard|first_step" "$out/$name.log" \
      | grep -v "leaked" | cut -c1-400; } >> "$out/summary.txt"
  [ "$code" -eq 0 ] || failed=1
}
# 1. default GuardConfig on a short step: GPT-2 small, torch.compile, bf16, fused AdamW, 4 x BATCH x 1024 tokens
run short_step 190 python3 -m scripts.bench.capture_overhead --config nanogpt --batch "$batch" \
  --modes guarded --rounds "$rounds" --steps "$steps"
# 2. the synchronous path: foreach AdamW (the default GuardConfig reads the step before optimizer.step())
run synchronous 190 python3 -m scripts.bench.capture_overhead --config nanogpt --batch "$batch" --foreach \
  --modes guarded --rounds "$rounds" --steps "$steps"
# 3. CLI start-up and the replay's first step of the demo dump (plain-torch GPT-2 recipe) on the GPU
demo=$(mktemp -d)
run demo 40 python3 -m forensics.cli demo -o "$demo" --device cpu
dump=$(ls -d "$demo"/dumps/demo-bad_sample/step-*/rank-00000 2>/dev/null | head -1)
if [ -n "$dump" ]; then
  run cli_startup 60 python3 -m scripts.bench.cli_startup --dump "$dump" --device cuda:0 --runs 5 --json "$out/cli_startup.json"
else
  echo "== cli_startup skipped: no demo dump" >> "$out/summary.txt"; failed=1
fi
cat "$out/card.txt" >> "$out/summary.txt"
cat "$out/summary.txt"
exit $failed
