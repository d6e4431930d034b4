#!/usr/bin/env bash
# Issue 53 at the limit (device tool, 2 GPUs, one call of <= 10 minutes per row set; BENCHMARKS.md "Streamed replay").
# Rows (ROWS="fsdp1b fsdp7b fsdp13b"): the FSDP2 bf16 Llama example (scripts/examples/fsdp2_example.py --size) on 2
# GPUs, plain SGD (OPTIM=adamw for moments; a 13 B AdamW dump of 2 ranks, 156 GB, does not fit the 128 GB disk):
#  1. the job: rank 1 reads an inf in step 3; each rank's dump stall (the job's own report line);
#  2. rank 1's dump replayed on cuda:0 in fresh processes (scripts/bench/replay_stream.py): unconstrained, and under
#     a quarter of the fp32 weights' size (BUDGETS, default none,quarter), the stage log, verdicts compared;
#  3. the dump deleted, 2 raw writers of one rank's bytes each at once on the same disk: the stall's baseline.
# NPROC=1: the job on one GPU (one rank: poison 14 is read in step 3, micro-batch 1), rank 0 replayed.
# Usage (repo root, .whl carried): ROWS="fsdp13b" bash scripts/gpu_big.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/gpu_big}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/examples PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/big
nvidia-smi -L; date -u +"%Y-%m-%d %H:%M UTC" | tee "$out/date.txt"; df -h /tmp | tail -1; free -g | head -2
flags=""; [ "${REMEDIES:-0}" = 1 ] || flags="$flags --no-remedies"; [ "${RNG:-1}" = 1 ] || flags="$flags --no-rng-check"
start=$SECONDS; failed=0
nproc=${NPROC:-2}; replayed=$((nproc - 1)); poison=29; [ "$nproc" = 1 ] && poison=14
for row in ${ROWS:-fsdp1b fsdp7b fsdp13b}; do
  rm -rf "$d"; mkdir -p "$d"  # one dump on the disk at a time
  size=${row#fsdp}; rowstart=$SECONDS
  echo "== $row ($size, ${OPTIM:-sgd})"
  timeout 300 torchrun --nproc_per_node="$nproc" scripts/examples/fsdp2_example.py --model llama --size "$size" --bf16 \
    --optimizer "${OPTIM:-sgd}" --poison "$poison" --poison-value inf --dump-dir "$d" --run-id "$row" \
    > "$out/$row-job.log" 2>&1 || { echo "job failed"; tail -30 "$out/$row-job.log"; failed=1; continue; }
  grep forensics-example "$out/$row-job.log" | cut -c1-400
  step_dir="$d/$row/step-000000003"
  du -sb "$step_dir"/rank-* | tee "$out/$row-sizes.txt"
  echo "-- job and dump: $((SECONDS - rowstart)) s"
  syncstart=$SECONDS; sync  # the dump's dirty pages written back before the replays, as after a job that ended
  echo "-- sync (the dump written back to the disk): $((SECONDS - syncstart)) s"
  timeout $((580 - (SECONDS - start))) python3 -m scripts.bench.replay_stream --dump "$step_dir" --rank "$replayed" \
    --device cuda:0 --budgets "${BUDGETS:-none,quarter}" $flags --json "$out/$row.json" 2>&1 | tee "$out/$row.log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  gb=$(awk "/rank-0000$replayed/ {print \$1 / 1e9}" "$out/$row-sizes.txt")
  rm -rf "$d"; mkdir -p "$d"
  if [ "${RAW:-1}" = 1 ] && [ -n "$gb" ]; then
    python3 -m scripts.bench.replay_scale --raw-only "$gb" --ranks "$nproc" --dir "$d" 2>&1 | tee "$out/$row-raw.log"
  fi
  echo "-- $row done: $((SECONDS - rowstart)) s"
done
rm -rf "$d"
echo "-- total: $((SECONDS - start)) s"
exit $failed
