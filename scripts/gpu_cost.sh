#!/usr/bin/env bash
# Issue 55 on one GPU (device tool, 1 GPU; ends within 8 minutes: each run stops starting rounds at its deadline and has
# a time limit above it): the healthy-step overhead of the Guard on a short step (nanoGPT GPT-2 small, torch.compile,
# bf16, fused AdamW: the default GuardConfig runs the sync-free check) and on the synchronous path (foreach AdamW: the
# default GuardConfig reads the step before optimizer.step(); beside it "synced", a loop's own NaN check by hand: the
# floor any exact check before the step pays). Interleaved rounds (scripts/bench/step_ratios.py: each mode its own
# compiled model, the order rotating every round, warm-up steps and WARM rounds discarded), the median of the per-round
# ratio guarded / plain with a 95 % bootstrap interval, then the host time per step of each piece of the Guard
# (scripts/bench/guard_pieces.py: wall and CPU, over PIECES steps after the rounds). Recompilations are logged
# (TORCH_LOGS=recompiles) and counted: one inside the rounds would swamp the ratio.
# Logs under OUT/<run>.log, the tables in OUT/summary.txt.
# Usage (repo root, .whl carried: forensics' dependencies): bash scripts/gpu_cost.sh "$OUT"
#   BATCH=6 (sequences per micro-batch: ~70 ms on an H200, ~100 ms on an H100) STEPS=20 (per round and mode)
#   DEADLINE=180 (seconds per run before its last round starts) WARM=2 PIECES=40 PROFILE=0 (3: steps of each mode under
#   torch.profiler after the rounds, run 1 only: the operators and kernel launches the Guard adds, with their host time;
#   the ratios are printed before it, so a profiler that makes dynamo recompile past the time limit loses only itself)
#   EXTRA="--tiny --no-compile" (a dry run of the script on a CPU)
set -uo pipefail
out=${1:-/tmp/gpu_cost}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
batch=${BATCH:-6} steps=${STEPS:-20} deadline=${DEADLINE:-180} warm=${WARM:-2} pieces=${PIECES:-40}
profile=${PROFILE:-0}
limit=$((deadline + 45))  # the last round (<= 3 modes x STEPS steps), the profiled steps, the pieces pass, the report
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/card.txt" 2>&1
failed=0
run() {  # run NAME CMD...: CMD's output in OUT/NAME.log, its tables in the summary
  local name=$1; shift
  local start=$SECONDS code=0
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || code=$?
  { echo "== $name (exit $code, $((SECONDS - start)) s, limit $limit s): $*"
    grep -E "^(machine|config|[0-9]+ interleaved|mode|plain|synced|guarded|synchronous|ratio|---|  )|inside the Guard|pieces" \
      "$out/$name.log" | grep -v "^--- cProfile" | cut -c1-400
    echo "recompilations logged: $(grep -c "Recompiling" "$out/$name.log") in all," \
      "$(sed -n '/^the rounds begin/,$p' "$out/$name.log" | grep -c "Recompiling") during the rounds (want 0)"
  } >> "$out/summary.txt"
  [ "$code" -eq 0 ] || failed=1
}
common=(--config nanogpt --batch "$batch" --rounds 500 --steps "$steps" --deadline "$deadline" --warm-rounds "$warm"
  --pieces "$pieces" ${EXTRA:-})
# 1. the default GuardConfig on a short step: fused AdamW, the sync-free check (goal <= 1.005)
run short_step python3 -m scripts.bench.capture_overhead "${common[@]}" --modes guarded --profile "$profile"
# 2. the synchronous path: foreach AdamW, so the default GuardConfig ("guarded") checks synchronously (goal <= 1.01),
#    beside "synced"
run synchronous python3 -m scripts.bench.capture_overhead "${common[@]}" --foreach --modes synced,guarded
cat "$out/card.txt" >> "$out/summary.txt"
cat "$out/summary.txt"
exit $failed
