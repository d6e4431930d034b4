#!/usr/bin/env bash
# Streamed replay on one GPU (issue 35; BENCHMARKS.md "Streamed replay"). One device call of <= 10 minutes on 2 GPUs:
# the FSDP2 bf16 Llama 7B dump as scripts/gpu_scale.sh's fsdp7b row makes it (2 ranks), then rank 1's step replayed on
# cuda:0 three times, each in a fresh process: unconstrained, --memory-budget 32GiB and 16GiB (the caching allocator
# capped at the budget with torch.cuda.set_per_process_memory_fraction; peak = torch.cuda.max_memory_allocated).
# Prints each replay's stages, the table (budget, peak, time, passes, K, block reads, blocks cast instead of read,
# blocks evicted for memory), whether verdict and sample agree, and the seconds per stage of each row. REMEDIES=1 / RNG=1 also run those stages (every row alike; longer than one call allows at 7B).
# Usage (repo root, .whl carried): bash scripts/gpu_stream.sh OUTDIR      (SIZE=1b for a quicker check)
set -uo pipefail
out=${1:-/tmp/gpu_stream}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/examples PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
size=${SIZE:-7b}; row=fsdp$size
d=/tmp/stream; rm -rf "$d"; mkdir -p "$d"
nvidia-smi -L; date -u +"%Y-%m-%d %H:%M UTC"; df -h /tmp | tail -1; free -g | head -2
start=$SECONDS
timeout 360 torchrun --nproc_per_node=2 scripts/examples/fsdp2_example.py --model llama --size "$size" --bf16 \
  --poison-value inf --dump-dir "$d" --run-id "$row" > "$out/$row-dump.log" 2>&1 || { tail -30 "$out/$row-dump.log"; exit 1; }
grep forensics-example "$out/$row-dump.log" | cut -c1-300
step_dir="$d/$row/step-000000003"
du -sb "$step_dir"/rank-*; echo "-- dump: $((SECONDS - start)) s"
flags=""; [ "${REMEDIES:-0}" = 1 ] || flags="$flags --no-remedies"; [ "${RNG:-0}" = 1 ] || flags="$flags --no-rng-check"
python3 -m scripts.bench.replay_stream --dump "$step_dir" --rank 1 --device cuda:0 --budgets "${BUDGETS:-none,32GiB,16GiB}" \
  $flags --json "$out/stream.json" 2>&1 | tee "$out/stream.log"
rc=${PIPESTATUS[0]}
echo "-- total: $((SECONDS - start)) s"
exit $rc
