#!/usr/bin/env bash
# The GPU acceptance run (device tool, 2 GPUs): multi-rank DeepSpeed dumps replayed on one GPU, fp16 loss-scale
# skips, the planted-fault scenarios on CUDA, the CUDA writer test and the write benchmark.
# Every step's full output goes to OUTDIR/<step>.log; the run stops at the first step that fails.
# Usage (repo root, .whl carried): bash scripts/gpu_acceptance.sh OUTDIR
set -euo pipefail
out=${1:-/tmp/gpu_acceptance}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/examples PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# step NAME EXPECTED_EXIT CMD...: runs CMD with its output in $out/NAME.log, shows the lines that matter,
# and fails the whole run unless CMD exits with EXPECTED_EXIT.
step() {
  local name=$1 expected=$2; shift 2
  echo "== $name"
  local code=0
  "$@" >"$out/$name.log" 2>&1 || code=$?
  grep -E "forensics-example|Verdict|OK:|scenarios give|passed|failed|GB/s|^\{" "$out/$name.log" | cut -c1-400 || true
  if [ "$code" -ne "$expected" ]; then
    echo "FAILED: $name exited $code, expected $expected (log: $out/$name.log)"; tail -20 "$out/$name.log"; exit 1
  fi
}

nvidia-smi -L
step zero3_llama 0 timeout 300 torchrun --nproc_per_node=2 scripts/examples/deepspeed_example.py --zero-stage 3 \
  --precision bf16 --model llama --poison-value inf --dump-dir /tmp/d --run-id z3llama
step zero3_verify 0 python3 -m forensics.cli verify /tmp/d/z3llama/step-000000003
step zero3_replay 0 python3 -m forensics.cli replay /tmp/d/z3llama/step-000000003 --rank 1 --device cuda:0 \
  -o "$out/z3llama"
step fp16_scale_collapse 0 timeout 300 torchrun --nproc_per_node=2 scripts/examples/deepspeed_example.py \
  --precision fp16 --initial-scale-power 40 --min-loss-scale 8589934592 --policy continue --steps 8 --poison -1 \
  --dump-dir /tmp/d --run-id fp16
step scenarios_cuda 0 python3 -m scripts.check_scenarios --device cuda:0 --json "$out/scenarios.json"
step cuda_writer_test 0 python3 -m pytest -q -p no:cacheprovider tests/forensics/test_format_cuda.py
step dump_write_bench 0 python3 -m scripts.bench.dump_write --dir /tmp --rounds 3
echo "all GPU acceptance steps passed; logs in $out"
