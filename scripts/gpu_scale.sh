#!/usr/bin/env bash
# The GPU rows of BENCHMARKS.md "Scale table" (device tool, 2 GPUs; each row is one call of <= 10 minutes).
# Rows (ROWS="..."): single07b = a 0.7 B Llama dumped and replayed on one GPU (scripts/bench/replay_scale.py);
# fsdp1b / fsdp7b = the FSDP2 bf16 Llama example of 1.06 B / 6.74 B parameters on 2 GPUs: each rank's dump stall,
# then the one-GPU replay of the step against cat and one pass, then (dump deleted, the disk being 128 GB) 2 raw
# writers of one rank's bytes each at once: the stall's baseline. JSON per row in OUTDIR; summaries on stdout.
# Usage (repo root, .whl carried): ROWS="fsdp7b" bash scripts/gpu_scale.sh OUTDIR   (RAW=0: no raw baseline)
set -uo pipefail
out=${1:-/tmp/gpu_scale}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/examples PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
d=/tmp/scale; rm -rf "$d"; mkdir -p "$d"
nvidia-smi -L; date -u +"%Y-%m-%d %H:%M UTC"; df -h /tmp | tail -1; free -g | head -2
failed=0
for row in ${ROWS:-fsdp7b}; do
  echo "== $row"; start=$SECONDS
  case $row in
    single07b)
      python3 -m scripts.bench.replay_scale --hidden 2048 --layers 12 --device cuda:0 --dir "$d" \
        --json "$out/$row.json" > "$out/$row.log" 2>&1 || failed=1 ;;
    fsdp1b|fsdp7b)
      size=${row#fsdp}
      timeout 400 torchrun --nproc_per_node=2 scripts/examples/fsdp2_example.py --model llama --size "$size" --bf16 \
        --poison-value inf --dump-dir "$d" --run-id "$row" > "$out/$row.log" 2>&1 || { failed=1; tail -30 "$out/$row.log"; }
      grep forensics-example "$out/$row.log" | cut -c1-400
      step_dir="$d/$row/step-000000003"
      du -sb "$step_dir"/rank-* 2>/dev/null
      python3 -m scripts.bench.replay_scale --dump "$step_dir" --rank 1 --device cuda:0 --json "$out/$row.json" \
        >> "$out/$row.log" 2>&1 || { failed=1; tail -30 "$out/$row.log"; }
      gb=$(du -sb "$step_dir"/rank-00001 | awk '{print $1 / 1e9}')
      rm -rf "$d/$row"
      [ "${RAW:-1}" = 1 ] && python3 -m scripts.bench.replay_scale --raw-only "$gb" --ranks 2 --dir "$d" | tee -a "$out/$row.log" ;;
    *) echo "unknown row $row"; failed=1 ;;
  esac
  [ -f "$out/$row.json" ] && python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r.pop('stages', None); print(json.dumps(r))" "$out/$row.json"
  [ -f "$out/$row.json" ] && python3 -c "import json,sys; [print(s) for s in json.load(open(sys.argv[1]))['stages']]" "$out/$row.json"
  echo "-- $row: $((SECONDS - start)) s"
done
exit $failed
