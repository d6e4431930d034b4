#!/usr/bin/env bash
# Issue 55 item 1 on one GPU (device tool, 1 GPU, <= 8 minutes by its timeouts, ~3 expected): the dump write from
# cuda:0 with large files written with O_DIRECT (forensics/format/direct_io.py), beside raw os.write + fsync, raw
# O_DIRECT, raw + sha256, dd, torch.save in the same rotation; then the direct-I/O tests on the machine's disk.
# Logs under OUT/<step>.log, one line each in OUT/summary.txt, the bench's JSON in OUT/dump_write.json.
# Usage (repo root, .whl carried: forensics' dependencies): bash scripts/gpu_dump_write.sh "$OUT"   (ROUNDS=3 DIR=/tmp)
set -uo pipefail
out=${1:-/tmp/gpu_dump_write}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/card.txt" 2>&1
{ findmnt -T "${DIR:-/tmp}" -no SOURCE,FSTYPE,OPTIONS; nproc; uptime; } > "$out/machine.txt" 2>&1
failed=0
run() {  # run NAME SECONDS CMD...: CMD's output in OUT/NAME.log, its result lines in the summary
  local name=$1 limit=$2; shift 2
  local start=$SECONDS code=0
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || code=$?
  { echo "== $name (exit $code, $((SECONDS - start)) s): $*"
    grep -E "GB/s|/ raw|the hash|sha256 beside|spike|passed|failed|skipped" "$out/$name.log" | cut -c1-400; } >> "$out/summary.txt"
  [ "$code" -eq 0 ] || failed=1
}
# 1. 1.46 GB of fp32 state + AdamW moments on cuda:0, every writer in the same rotation
run dump_write 360 python3 -m scripts.bench.dump_write --device cuda:0 --dir "${DIR:-/tmp}" --rounds "${ROUNDS:-3}" \
  --json "$out/dump_write.json"
# 2. the direct write's tests on this machine's file system (bytes, digests, page cache, a failing write, EINVAL)
run direct_io_tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/forensics/test_format_direct_io.py \
  tests/forensics/test_format_digest.py tests/forensics/test_format_writeback.py tests/forensics/test_format_cuda.py
cat "$out/summary.txt"
exit $failed
