#!/usr/bin/env bash
# Issue 55 on one GPU (device tool, 1 GPU; ends in about DEADLINE + 60 s, ~5 minutes with the default): the Guard's
# healthy-step cost on a short step (nanoGPT GPT-2 small, torch.compile, bf16, fused AdamW: the default GuardConfig runs
# the sync-free check; goal <= 1.005) and on the synchronous path (foreach AdamW: the default GuardConfig reads the
# step before optimizer.step(); goal <= 1.01), beside "synced", a loop's own isfinite(norm).item() by hand (the floor
# any exact check before the step pays).
# 1. paired: scripts/bench/paired_cost.py, in one process: every arm its own compiled copy; blocks of BLOCK steps in
#    units B X X B (B the arm's plain baseline with the same optimizer), the units interleaved, each step's start a
#    CUDA event (no sync between blocks); the median of the units' ratios with a 95 % bootstrap interval, the geometric
#    mean with a t interval; then each arm's GPU-idle time per step (torch.profiler, CUDA activity only: stream time
#    minus kernel time; the arm's idle beyond its baseline's is the Guard's host time that shows through) and the host
#    time of each piece of the Guard (scripts/bench/guard_pieces.py).
# 2. OLD=1: then the interleaved-rounds bench as before (scripts/bench/step_ratios.py: rounds of STEPS steps per mode,
#    a sync around each round; its between-round spread is what 1. was made to beat), two more runs of OLD_DEADLINE s.
# Recompilations are logged (TORCH_LOGS=recompiles) and counted: one inside the measurement would swamp the ratio.
# Logs under OUT/<run>.log, the tables in OUT/summary.txt.
# Usage (repo root, .whl carried: forensics' dependencies): bash scripts/gpu_cost.sh "$OUT"
#   DEADLINE=240 (seconds from the start, compiling included, after which no unit starts) BATCH=6 (sequences per
#   micro-batch: ~70 ms on an H200, ~85 ms on an H100) BLOCK=3 (steps per block) ARMS=guarded,toggled,guarded_foreach,synced
#   PROFILE=8 (steps of each arm under the profiler; 0: none) PIECES=40 OLD=0 OLD_DEADLINE=120 STEPS=20
#   EXTRA="--tiny --no-compile" (a dry run of the script on a CPU)
set -uo pipefail
out=${1:-/tmp/gpu_cost}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
python=$(command -v python3 || command -v python)
deadline=${DEADLINE:-240} batch=${BATCH:-6} block=${BLOCK:-3} arms=${ARMS:-guarded,toggled,guarded_foreach,synced}
profile=${PROFILE:-8} pieces=${PIECES:-40}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv,noheader > "$out/card.txt" 2>&1
failed=0
run() {  # run NAME LIMIT CMD...: CMD's output in OUT/NAME.log, its tables in the summary
  local name=$1 limit=$2; shift 2
  local start=$SECONDS code=0
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || code=$?
  { echo "== $name (exit $code, $((SECONDS - start)) s, limit $limit s): $*"
    grep -E "^(machine|model|config|RNG capture|forensics log|[0-9]+ (units|interleaved)|arm |mode|plain|synced|guarded|synchronous|ratio|---|  )|inside the Guard|pieces" \
      "$out/$name.log" | grep -v "^--- cProfile" | cut -c1-400
    echo "recompilations logged: $(grep -c "Recompiling" "$out/$name.log") in all," \
      "$(sed -n '/^the rounds begin/,$p' "$out/$name.log" | grep -c "Recompiling") during the measurement (want 0)"
  } >> "$out/summary.txt"
  [ "$code" -eq 0 ] || failed=1
}
# 1. paired blocks (the figure of record)
run paired $((deadline + 90)) "$python" -m scripts.bench.paired_cost --batch "$batch" --block "$block" --arms "$arms" \
  --deadline "$deadline" --profile "$profile" --pieces "$pieces" ${EXTRA:-}
# 2. the interleaved rounds, as before 2026-11-28 (for comparison)
if [ "${OLD:-0}" = 1 ]; then
  old=${OLD_DEADLINE:-120}
  common=(--config nanogpt --batch "$batch" --rounds 500 --steps "${STEPS:-20}" --deadline "$old" --warm-rounds 2
    ${EXTRA:-})
  run rounds_short_step $((old + 45)) "$python" -m scripts.bench.capture_overhead "${common[@]}" --modes guarded
  run rounds_synchronous $((old + 45)) "$python" -m scripts.bench.capture_overhead "${common[@]}" --foreach \
    --modes synced,guarded
fi
cat "$out/card.txt" >> "$out/summary.txt"
cat "$out/summary.txt"
exit $failed
