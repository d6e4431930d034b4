#!/usr/bin/env bash
# Issue 50 (device tool, 1 GPU, ~2 minutes): why the new user's GPT-2 GPU dumps (tests/data/natural_gpu/gpt2_newuser_*)
# have a NaN gradient norm on the GPU and a finite one on the CPU. Each dump's step is replayed on cuda and on the cpu
# with the replay's own tools under each SDPA backend (math / efficient / flash / cudnn), eager attention and fp32:
# where the first non-finite gradient appears (anomaly mode), whether the gradients hold NaN or only their norm
# overflows, the attention kernels the profiler saw, the attention logits against fp32's exp limit
# (scripts/natural_gpu/attention_backends.py). Then every gpt2_newuser dump replayed with `forensics replay` on cuda
# and cpu (scripts/natural_gpu/replay_archives.py): both must give verdicts.json's model_state.
# Logs and a summary in OUTDIR. Usage (repo root): bash scripts/gpu_newuser_attention.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/gpu_newuser_attention}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then  # forensics' dependencies (zstandard, click) where the machine lacks them
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
date -u +"%Y-%m-%d %H:%M UTC" | tee "$out/date.txt"
failed=0
timeout 300 python3 -m scripts.natural_gpu.attention_backends "$out" --device cuda:0 --device cpu 2>&1 \
  | grep -v Warning | tee "$out/attention_backends.log" || failed=1
for device in cuda:0 cpu; do
  timeout 200 python3 - "$out" "$device" <<'PY' 2>&1 | tee -a "$out/replays.log" || failed=1
import json, sys
from pathlib import Path
from click.testing import CliRunner
from forensics.cli import main
out, device = Path(sys.argv[1]), sys.argv[2]
data = Path("tests/data/natural_gpu")
index = json.loads((data / "verdicts.json").read_text())["dumps"]
bad = 0
for name in sorted(n for n in index if n.startswith("gpt2_newuser")):
    report_dir = out / f"report-{device.replace(':', '')}-{name.removesuffix('.tar.zst')}"
    result = CliRunner().invoke(main, ["replay", str(data / name), "--device", device, "--trust", "--path", ".",
                                       "--no-rng-check", "-o", str(report_dir)])
    report = json.loads((report_dir / "report.json").read_text())
    kind, named = report["verdict"]["kind"], report["culprit"]["samples"]
    ok = kind == index[name]["gpu_verdict"] and not named and not (report_dir / "blocklist.jsonl").exists()
    bad += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {device:6s} {name:50s} exit {result.exit_code} {kind}: {report['verdict']['headline']}")
sys.exit(1 if bad else 0)
PY
done
echo "-- summary" | tee "$out/summary.txt"
grep -E "^== |first non-finite|job's kernels|held to|eager|fp32" "$out/attention_backends.log" >> "$out/summary.txt"
grep -E "^(ok|FAIL)" "$out/replays.log" >> "$out/summary.txt"
cat "$out/summary.txt"
exit $failed
