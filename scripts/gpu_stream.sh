#!/usr/bin/env bash
# Streamed replay on one GPU (issues 35 and 53; BENCHMARKS.md "Streamed replay"). One device call of <= 10 minutes.
# Rows (ROWS="1b 3b", the default): a Llama of that shape (scripts/examples/_common.py SIZES, 3b: 3200 wide, 26 layers)
# dumped on cuda:0 by scripts/bench/replay_scale.write_dump (fp32 weights, AdamW moments, one sample's input holding
# an inf), then replayed in fresh processes (scripts/bench/replay_stream.py): unconstrained, under a quarter of the
# fp32 weights' size (or the least budget the plan takes where a quarter leaves no room beside the embeddings) with
# the schedule before issue 53 (":old": every pass reads the dump, one walk per pass), and the same budget with the
# current one (host cache of the blocks, forward passes block-major). Each budget is enforced: the caching
# allocator is capped at it. Prints per row the stages, the table (time, passes, block reads, GiB read from the
# dump / host->device / floor, walks), the ratios to the unconstrained replay and new vs old, whether verdicts agree,
# then the 70B projection from each row (projection.log). ":old" is the schedule before issue 53 (no host cache, one
# walk per pass, passes with a backward alone) but for the per-layer table, which every replay reads from reproduce.
# Row fsdp7b: the 2-GPU FSDP2 bf16 7B dump of issue 35 (needs nvidia-h100-x2), rank 1 replayed the same way.
# Usage (repo root, .whl carried): bash scripts/gpu_stream.sh OUTDIR   (ROWS="1b" for a quicker check; REMEDIES=1 also
# runs the remedies in every row; RNG=0 leaves out the other-seeds check)
set -uo pipefail
out=${1:-/tmp/gpu_stream}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/examples PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L; date -u +"%Y-%m-%d %H:%M UTC"; df -h /tmp | tail -1; free -g | head -2
flags=""; [ "${REMEDIES:-0}" = 1 ] || flags="$flags --no-remedies"; [ "${RNG:-1}" = 1 ] || flags="$flags --no-rng-check"
start=$SECONDS; failed=0
for row in ${ROWS:-1b 3b}; do
  d=/tmp/stream; rm -rf "$d"; mkdir -p "$d"  # one dump on the disk at a time (3b: 41 GB of weights and moments)
  echo "== $row"
  if [ "$row" = fsdp7b ]; then
    timeout 360 torchrun --nproc_per_node=2 scripts/examples/fsdp2_example.py --model llama --size 7b --bf16 \
      --poison-value inf --dump-dir "$d" --run-id "$row" > "$out/$row-dump.log" 2>&1 || { tail -30 "$out/$row-dump.log"; failed=1; continue; }
    dump="$d/$row/step-000000003"; rank=1; budgets=${BUDGETS:-none,16GiB:old,16GiB}
  else
    case $row in
      1b) shape="2048 18 5632" ;;
      3b) shape="3200 26 8640" ;;
      *) echo "unknown row $row"; failed=1; continue ;;
    esac
    timeout 240 python3 - "$d" $shape > "$out/$row-dump.log" 2>&1 <<'EOF' || { tail -30 "$out/$row-dump.log"; failed=1; continue; }
import argparse, sys
from pathlib import Path
from scripts.bench.replay_scale import write_dump
hidden, layers, inter = (int(v) for v in sys.argv[2:5])
args = argparse.Namespace(device="cuda:0", hidden=hidden, layers=layers, intermediate=inter, vocab=32000, seq=128,
                          batch=8, micro=2)
path, stall = write_dump(args, Path(sys.argv[1]))
print(f"DUMP {path} stall {stall:.1f} s")
EOF
    dump=$(grep -o 'DUMP [^ ]*' "$out/$row-dump.log" | cut -d' ' -f2); rank=-; budgets=${BUDGETS:-none,quarter:old,quarter}
  fi
  du -sh "$dump"; echo "-- dump: $((SECONDS - start)) s"
  syncstart=$SECONDS; sync  # the dump's dirty pages written back before the replays, as after a job that ended
  echo "-- sync (the dump written back to the disk): $((SECONDS - syncstart)) s"
  timeout $((560 - (SECONDS - start))) python3 -m scripts.bench.replay_stream --dump "$dump" --rank "$rank" \
    --device cuda:0 --budgets "$budgets" $flags --json "$out/$row.json" 2>&1 | tee "$out/$row.log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  echo "-- $row done: $((SECONDS - start)) s"
done
rm -rf /tmp/stream
for row in ${ROWS:-1b 3b}; do  # the 70B projection from each measured row (scripts/bench/stream_projection.py)
  [ -f "$out/$row.json" ] || continue
  for budget in quarter 40GiB; do
    echo "== projection from $row, budget $budget"
    python3 -m scripts.bench.stream_projection --json "$out/$row.json" --budget $budget --host-memory 1TB \
      --disk-gbps 3 --pcie-gbps 50 2>&1 | tee -a "$out/projection.log"
  done
done
echo "-- total: $((SECONDS - start)) s"
exit $failed
