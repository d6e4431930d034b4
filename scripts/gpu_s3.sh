#!/usr/bin/env bash
# Object storage on the GPU machine (device tool, 1 GPU, <= 10 minutes): a local S3 server (moto), an FSDP2 bf16 job
# on the GPU (NCCL) whose dump_dir is s3://..., nothing on the local disk, then list / verify / replay from the URL
# on cuda:0; last, the object-storage tests under the machine's Python and torch.
# Usage (repo root, .whl carried with s3fs and moto[server]): bash scripts/gpu_s3.sh OUTDIR
#   ONLY=bench bash scripts/gpu_s3.sh OUTDIR: only the URL replay against download-then-replay (remote_load, whole
#   commands, interleaved rounds) on the machine's 16 cores: the 0.35 GB dump (3 rounds), then a 2.4 GB one (2 rounds).
set -uo pipefail
out=${1:-/tmp/gpu_s3}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/examples PYTHONUNBUFFERED=1
if [ "${ONLY:-}" = bench ]; then
  nproc; uptime | tee "$out/load.txt"
  timeout 200 python3 -m scripts.bench.remote_load --hidden 384 --layers 4 --rounds 3 --dir /tmp/rl_small \
    > "$out/remote_load_small.log" 2>&1; echo "small exit $?: $(tail -1 "$out/remote_load_small.log")" | tee -a "$out/summary.txt"
  timeout 260 python3 -m scripts.bench.remote_load --hidden 1024 --layers 12 --rounds 2 --dir /tmp/rl_large \
    > "$out/remote_load_large.log" 2>&1; echo "large exit $?: $(tail -1 "$out/remote_load_large.log")" | tee -a "$out/summary.txt"
  exit 0
fi
export AWS_ENDPOINT_URL=http://127.0.0.1:5055 AWS_ACCESS_KEY_ID=gpu AWS_SECRET_ACCESS_KEY=gpu-secret-key AWS_DEFAULT_REGION=us-east-1
nvidia-smi -L; python3 -c "import torch, s3fs; print('torch', torch.__version__, 's3fs', s3fs.__version__)"
date -u +"%Y-%m-%d %H:%M UTC" | tee "$out/date.txt"
python3 -m moto.server -H 127.0.0.1 -p 5055 > "$out/moto.log" 2>&1 &
for _ in $(seq 100); do python3 -c "import socket; socket.create_connection(('127.0.0.1', 5055), 0.3)" 2>/dev/null && break; sleep 0.2; done
python3 -c "import s3fs; s3fs.S3FileSystem().mkdir('gpu-dumps')"
failed=0
work=$(mktemp -d); before=$(find "$work" . -newer "$out/date.txt" -name 'rank-*' 2>/dev/null | wc -l)
( cd "$work" && timeout 300 torchrun --nproc_per_node=1 "$OLDPWD/scripts/examples/fsdp2_example.py" --bf16 \
    --poison 13 --dump-dir s3://gpu-dumps/d --run-id s3 ) > "$out/train.log" 2>&1
grep -E "forensics-example|dump written|TrainingFault" "$out/train.log" | cut -c1-300 | tail -5
after=$(find "$work" . -newer "$out/date.txt" -name 'rank-*' 2>/dev/null | wc -l)
echo "local rank-* directories written by the job: $((after - before))" | tee -a "$out/summary.txt"
python3 -m forensics.cli list s3://gpu-dumps/d | tee "$out/list.log"
step=$(python3 -m forensics.cli list s3://gpu-dumps/d --json | python3 -c "import json,sys; print(json.load(sys.stdin)['dumps'][0]['path'])")
echo "step dump: $step" | tee -a "$out/summary.txt"
python3 -m forensics.cli verify "$step" > "$out/verify.log" 2>&1; echo "verify exit $?" | tee -a "$out/summary.txt"
python3 -c "
from forensics.format import open_dump
d = open_dump('$step'); print('sharded', d.sharded, 'world', d.world_size, 'dtensor', d.manifest['distributed'].get('dtensor'))" \
  | tee -a "$out/summary.txt"
start=$SECONDS
python3 -m forensics.cli replay "$step" --device cuda:0 -o "$out/replay" > "$out/replay.log" 2>&1
echo "replay exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
python3 -c "import json; r=json.load(open('$out/replay/report.json')); print('verdict', r['verdict']['kind'], 'samples', [s['sample_id'] for s in r['culprit']['samples']], 'module', r['culprit'].get('module'), 'device', r['environment']['replay'].get('device'))" \
  | tee -a "$out/summary.txt" || failed=1
grep -c "gpu-secret-key" "$out"/*.log "$out/replay/report.json" | tee -a "$out/summary.txt"
CUDA_VISIBLE_DEVICES= timeout 400 python3 -m pytest -q -p no:cacheprovider tests/storage > "$out/tests.log" 2>&1
echo "tests/storage exit $?: $(tail -1 "$out/tests.log")" | tee -a "$out/summary.txt"
kill %1 2>/dev/null
# the remote load against a whole download and a local load, on this machine's cores (its own moto server)
timeout 300 python3 -m scripts.bench.remote_load --hidden 384 --layers 4 --rounds 2 > "$out/remote_load.log" 2>&1
echo "remote_load: $(tail -1 "$out/remote_load.log")" | tee -a "$out/summary.txt"
exit $failed
