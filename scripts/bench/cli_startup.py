"""CLI start-up: `forensics inspect / verify / list` on a small dump, and the time `forensics replay` of the demo's dump
takes to reach its first replayed step, against a bare interpreter and `import torch` measured in the same run
(medians of N runs of each, interleaved).

    python -m scripts.bench.cli_startup --dump DUMP_DIR [--hf-dump HF_DUMP_DIR] [--runs 7] [--json OUT]

DUMP_DIR: the demo's dump (`forensics demo -o /tmp/fxdemo --device cpu`, then
/tmp/fxdemo/dumps/demo-bad_sample/step-*/rank-00000). "first replayed step": from the process start to the
replay's progress line "reproducing the step" (printed right before the step is first re-executed); the
process is stopped there. HF_DUMP_DIR: a demo dump of a release before the plain-torch GPT-2 (its recipe names
forensics.recipes:huggingface_model, so its replay imports transformers), timed the same way in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import tempfile
import time

FIRST_STEP_MARK = b"reproducing the step"


def _time(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def _time_to_first_step(cmd: list[str]) -> float:
    start = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for line in process.stderr:
            if FIRST_STEP_MARK in line:
                return time.perf_counter() - start
        raise SystemExit(f"{' '.join(cmd)} ended before its first replayed step (exit {process.wait()})")
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dump", required=True)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--hf-dump", help="a demo dump whose recipe builds transformers' GPT2LMHeadModel")
    parser.add_argument("--device", default="cpu", help="the replay's device (cuda:N on a GPU machine)")
    parser.add_argument("--json", help="also write the medians here")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "forensics.cli"]
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        # the replay pauses the garbage collector while it imports (forensics/core/gc_pause.py): the same for torch
        "import torch, GC paused": [sys.executable, "-c", "import gc; gc.disable(); import torch"],
        "forensics inspect": [*cli, "inspect", args.dump],
        "forensics verify": [*cli, "verify", args.dump],
        "forensics list": [*cli, "list", args.dump],
        "forensics replay: first replayed step": [
            *cli,
            "replay",
            args.dump,
            "--device",
            args.device,
            "-o",
            os.path.join(tempfile.mkdtemp(prefix="cli-startup-"), "report"),  # stopped before it writes one
        ],
    }
    if args.hf_dump:
        replay = commands["forensics replay: first replayed step"]
        commands["forensics replay: first replayed step (transformers GPT-2 dump)"] = [
            *replay[:4],
            args.hf_dump,
            *replay[5:],
        ]
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            times[name].append(_time_to_first_step(cmd) if name.startswith("forensics replay") else _time(cmd))
    medians = {name: statistics.median(values) for name, values in times.items()}
    base, torch_s = medians["python -c pass"], medians["python -c 'import torch'"]
    for name, median in medians.items():
        print(f"| {name} | {median:.3f} s | {median / base:.1f}x | {median - torch_s:+.2f} s |")
    from scripts.bench.common import machine

    summary = {
        "machine": machine(),
        "runs": args.runs,
        "seconds": {k: round(v, 3) for k, v in medians.items()},
        "first_step_after_import_torch_s": round(medians["forensics replay: first replayed step"] - torch_s, 3),
        "first_step_after_import_torch_gc_paused_s": round(
            medians["forensics replay: first replayed step"] - medians["import torch, GC paused"], 3
        ),
    }
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)


if __name__ == "__main__":
    main()
