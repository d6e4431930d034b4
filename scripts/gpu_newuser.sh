#!/usr/bin/env bash
# Issue 50 item 1 on a GPU (device tool, 1 GPU, <= 8 minutes): the new user's GPT-2 (2 layers x 32, from a config, plain
# SGD, eight samples per step, nothing wrong with the data; tests/natural/gpt2_lr_job.py) trained on cuda at lr 18 in
# bf16 autocast, at lr 12 and 30 in bf16, and at lr 18 in fp32; each NaN dump replayed on cuda and on the cpu. Prints
# per run and device the verdict, the samples named (as triggers), whether a blocklist was written; a run fails when a
# replay blames a record (bad_sample, a blocklist, a sample not marked as a trigger, a "Filter" line) or the cuda and
# cpu replays of the same dump give different verdicts. Logs in OUTDIR/<run>.log, one line per run in summary.txt.
# Each run's dump packed into OUTDIR/packed/gpt2_newuser_<precision>_<lr>-<step>.tar.zst, the names of the test data in
# tests/data/natural_gpu (tests/natural/test_gpu_dumps.py replays them on the CPU; verdicts.json records the GPU's).
# Usage (repo root; a carried .whl is used when there is one): bash scripts/gpu_newuser.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/gpu_newuser}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
d=/tmp/newuser; rm -rf "$d"; mkdir -p "$d"
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
date -u +"%Y-%m-%d %H:%M UTC" | tee "$out/date.txt"
failed=0
run() {  # run NAME ARGS...: one training on cuda, its dump replayed on cuda and cpu
  local name=$1; shift
  local start=$SECONDS code=0
  echo "== $name"
  timeout 170 python3 tests/natural/gpt2_lr_job.py "$d/$name" "$@" --device cuda --replay-on cuda,cpu \
    > "$out/$name.log" 2>&1 || code=$?
  python3 - "$out/$name.log" "$name" <<'PY' | tee -a "$out/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    if "device" in r:
        print(f"{sys.argv[2]:<10} replay on {r['device']:<5} exit {r['exit_code']} verdict {r['verdict']:<20} "
              f"samples {r['samples']} triggers {r['triggers']} blocklist {r['blocklist']} problems {r['problems']}")
    else:
        print(f"{sys.argv[2]:<10} {r}")
PY
  mkdir -p "$out/packed"  # each dump packed for tests/data/natural_gpu (a 2 x 32 GPT-2: a few hundred KB)
  for m in $(find "$d/$name" -name manifest.json -path "*step-*" 2>/dev/null | head -4); do
    step_dir=$(dirname "$(dirname "$m")"); [ -d "$step_dir" ] || continue
    python3 -m forensics.cli pack "$step_dir" -o "$out/packed/gpt2_newuser_${name/-/_}-$(basename "$step_dir").tar.zst" --force \
      >> "$out/$name.log" 2>&1 || true
  done
  if [ "$code" -ne 0 ]; then
    echo "FAIL $name exit=$code $((SECONDS - start))s" | tee -a "$out/summary.txt"; tail -20 "$out/$name.log"; failed=1
  else
    echo "ok   $name $((SECONDS - start))s" >> "$out/summary.txt"
  fi
}
run bf16-lr18 --lr 18
run bf16-lr12 --lr 12
run bf16-lr30 --lr 30
run fp32-lr18 --lr 18 --fp32
echo "-- summary"; cat "$out/summary.txt"
exit $failed
