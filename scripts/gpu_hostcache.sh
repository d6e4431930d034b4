#!/usr/bin/env bash
# The streamed replay's host cache on one GPU (issue 53; replay/load/host_cache.py): filled beside the load (slabs
# page-locked by background threads, each tensor copied in on the cache's own stream), and held in the dtype the
# passes compute in. One device call of <= 8 minutes, 1 GPU:
#   0. scripts/bench/host_cache_fill.py: the fill's rate by fill threads (1, 2, 4), alone and beside page-cache readers.
#   1. tests/replay/test_host_cache_cuda.py: the async copy-in against a stream that overwrites its sources, element
#      by element; the fill threads' slabs, the unused ones freed.
#   2. the 1b row of scripts/gpu_stream.sh (fp32 Llama, 18 blocks): unconstrained vs a quarter of the fp32 weights,
#      fresh processes, the stage log printed (the plan's "host cache:" line: bytes, dtype, fill time, load's wait).
#   3. the same dump as an FSDP2 bf16 job (its manifest's precision.fsdp: param_dtype bfloat16 over the fp32 weights,
#      which no checksum covers): the cache holds bf16 copies (half the bytes per walk) and, with the host's room,
#      the fp32 values beside them for the fp32 re-run; the same verdict unconstrained and in a quarter.
# Usage (repo root, .whl carried): bash scripts/gpu_hostcache.sh [OUTDIR]   (default $OUT); summary in OUTDIR/summary.txt
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu_hostcache}}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/examples PYTHONUNBUFFERED=1
nvidia-smi -L; date -u +"%Y-%m-%d %H:%M UTC"; free -g | head -2
start=$SECONDS; failed=0
echo "== fill rate"
timeout 120 python3 -m scripts.bench.host_cache_fill --gib 8 --threads 1,2,4 2>&1 | tee "$out/fill.log"
[ "${PIPESTATUS[0]}" = 0 ] || failed=1
echo "== cuda tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/replay/test_host_cache_cuda.py 2>&1 | tee "$out/tests.log" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || failed=1
d=/tmp/hostcache; rm -rf "$d"; mkdir -p "$d"
echo "== dump 1b"
timeout 240 python3 - "$d" 2048 18 5632 > "$out/1b-dump.log" 2>&1 <<'PY' || { tail -30 "$out/1b-dump.log"; exit 1; }
import argparse, sys
from pathlib import Path
from scripts.bench.replay_scale import write_dump
hidden, layers, inter = (int(v) for v in sys.argv[2:5])
args = argparse.Namespace(device="cuda:0", hidden=hidden, layers=layers, intermediate=inter, vocab=32000, seq=128,
                          batch=8, micro=2)
path, stall = write_dump(args, Path(sys.argv[1]))
print(f"DUMP {path} stall {stall:.1f} s")
PY
dump=$(grep -o 'DUMP [^ ]*' "$out/1b-dump.log" | cut -d' ' -f2); du -sh "$dump"; echo "-- dump: $((SECONDS - start)) s"
for row in 1b 1b-fsdp-bf16; do
  if [ "$row" = 1b-fsdp-bf16 ]; then
    python3 - "$dump/manifest.json" <<'PY'
import json, sys
path = sys.argv[1]
manifest = json.load(open(path))
manifest["precision"]["fsdp"] = [{"module": "", "param_dtype": "bfloat16", "reduce_dtype": "float32",
                                  "cast_forward_inputs": True}]
json.dump(manifest, open(path, "w"))
PY
  fi
  echo "== $row"
  timeout $((450 - (SECONDS - start))) python3 -m scripts.bench.replay_stream --dump "$dump" --device cuda:0 \
    --budgets none,quarter --no-remedies --json "$out/$row.json" 2>&1 | tee "$out/$row.log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  echo "-- $row done: $((SECONDS - start)) s"
done
rm -rf "$d"
{
  date -u +"%Y-%m-%d %H:%M UTC"; nvidia-smi -L
  cat "$out/fill.log"
  tail -3 "$out/tests.log"
  for row in 1b 1b-fsdp-bf16; do
    echo "== $row"
    grep -E "host cache:|x the unconstrained|same verdict|fell back|streamed replay, in all|^\| (budget|stage|none|[0-9])|^\| (loading|reproducing|re-running|per-sample|bisecting)" "$out/$row.log"
  done
  echo "failed=$failed total $((SECONDS - start)) s"
} > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
exit $failed
