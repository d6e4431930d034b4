#!/usr/bin/env bash
# Issue 53, passes and micro-batches run together on a GPU under an enforced budget (1 GPU, ~4 minutes). The 1b row of
# scripts/gpu_stream.sh (Llama 2048 wide, 18 layers, fp32 weights, 2 micro-batches of 8 samples, one sample's input
# holding an inf): replayed unconstrained and at the least budget the plan takes (a quarter of the fp32 weights is
# too small for the part outside the blocks: 2 GiB), the CUDA caching allocator capped at it. Prints the stage log
# (each stage's passes and walks over the blocks), the groups the passes / micro-batches ran together in and why,
# and `stream.joint_backward_errors` (an engine call that raised: split in halves or run alone).
# What to look for: "reproducing the step" 2 walks (was 4), "per-sample loss and gradient norm" a few groups of
# passes run together (was 17 passes / 18 walks: the joint backward ran out of memory), same verdict in both rows.
# Usage (repo root, .whl carried): bash scripts/gpu_jointpasses.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/gpu_jointpasses}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/examples PYTHONUNBUFFERED=1
nvidia-smi -L; date -u +"%Y-%m-%d %H:%M UTC"
start=$SECONDS
d=/tmp/jointpasses; rm -rf "$d"; mkdir -p "$d"
timeout 240 python3 - "$d" > "$out/dump.log" 2>&1 <<'PY' || { tail -30 "$out/dump.log"; exit 1; }
import argparse, sys
from pathlib import Path
from scripts.bench.replay_scale import write_dump
args = argparse.Namespace(device="cuda:0", hidden=2048, layers=18, intermediate=5632, vocab=32000, seq=128, batch=8,
                          micro=2)
path, stall = write_dump(args, Path(sys.argv[1]))
print(f"DUMP {path} stall {stall:.1f} s")
PY
dump=$(grep -o 'DUMP [^ ]*' "$out/dump.log" | cut -d' ' -f2)
echo "-- dump: $((SECONDS - start)) s ($dump)"
timeout $((470 - (SECONDS - start))) python3 -m scripts.bench.replay_stream --dump "$dump" --device cuda:0 \
  --budgets "${BUDGETS:-none,quarter}" --no-remedies --json "$out/1b.json" 2>&1 | tee "$out/1b.log"
rc=${PIPESTATUS[0]}
{
  echo "== stage log of the budgeted row: each stage's passes and walks, the groups run together"
  grep -E '^\s+\[' "$out/1b.log" | grep -v '\[none' | head -60
  python3 - "$out/1b.json" <<'PY'
import json, sys
for row in json.load(open(sys.argv[1])):
    stream = row.get("stream") or {}
    if not stream:
        continue
    print(f"{row['budget']}: {row.get('replay_s')} s, passes {row.get('passes')}, walks {stream.get('walks')}, "
          f"joint backwards {stream.get('joint_backwards')}, verdict {row.get('verdict')} {row.get('culprits')}")
    print("  joint_groups:", json.dumps(stream.get("joint_groups"), indent=None))
    print("  joint_backward_errors:", json.dumps(stream.get("joint_backward_errors"), indent=None))
PY
} 2>&1 | tee "$out/summary.txt"
rm -rf "$d"
echo "-- total: $((SECONDS - start)) s"
exit $rc
