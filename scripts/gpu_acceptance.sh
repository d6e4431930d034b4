#!/usr/bin/env bash
# The GPU acceptance run (device tool, 2 GPUs): multi-rank DeepSpeed dumps replayed on one GPU, fp16 loss-scale
# skips, the planted-fault scenarios on CUDA, the CUDA writer test and the write benchmark.
# Usage (repo root, .whl carried): bash scripts/gpu_acceptance.sh OUTDIR
set -u
out=${1:-/tmp/gpu_acceptance}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/examples PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fx() { python3 -m forensics.cli "$@"; }
nvidia-smi -L
echo "== ZeRO-3 bf16, small Llama, 2 GPUs"
timeout 300 torchrun --nproc_per_node=2 scripts/examples/deepspeed_example.py --zero-stage 3 --precision bf16 \
  --model llama --poison-value inf --dump-dir /tmp/d --run-id z3llama 2>&1 | grep "forensics-example" | cut -c1-400
fx verify /tmp/d/z3llama/step-000000003 | tail -1
fx replay /tmp/d/z3llama/step-000000003 --rank 1 --device cuda:0 -o "$out/z3llama" 2>/dev/null | head -6
echo "== DeepSpeed fp16: loss-scale skips are history, a dump once the scale collapses"
timeout 300 torchrun --nproc_per_node=2 scripts/examples/deepspeed_example.py --precision fp16 --initial-scale-power 40 \
  --min-loss-scale 8589934592 --policy continue --steps 8 --poison -1 --dump-dir /tmp/d --run-id fp16 2>&1 \
  | grep "forensics-example" | cut -c1-700
echo "== scenarios on cuda:0"
python3 -m scripts.check_scenarios --device cuda:0 --json "$out/scenarios.json" 2>&1 | grep -E '^\{|scenarios give'
echo "== CUDA writer test"
python3 -m pytest -q -p no:cacheprovider tests/forensics/test_format_cuda.py 2>&1 | tail -1
echo "== dump_write"
python3 -m scripts.bench.dump_write --dir /tmp --rounds 3 2>&1 | grep -v 'dump written'
