"""Replay the natural-run dumps kept as test data (tests/data/natural_gpu) on one device and compare each verdict with
the one recorded in verdicts.json (the same check tests/natural/test_gpu_dumps.py makes on the CPU):

    python -m scripts.natural_gpu.replay_archives OUT --device cuda:0 [--write]

The gpt2_newuser_* dumps come from scripts/gpu_newuser.sh (the new user's GPT-2 at learning rates far too high; each
entry's `made` says so), the others from scripts/natural_gpu/make_dumps.py.

Prints one line per dump and a JSON summary to OUT/replayed.json; exits 1 when a dump blames data, writes a blocklist
or gets another verdict than the recorded one. `--write` records this device's verdicts as `gpu_verdict` instead
(run it on the GPU machine after a change of the rules, then check the CPU agrees with the test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from forensics.cli import main as forensics

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "natural_gpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--write", action="store_true", help="record this device's verdicts in verdicts.json")
    args = parser.parse_args()
    index = json.loads((DATA / "verdicts.json").read_text())
    rows, problems = {}, []
    for name, entry in sorted(index["dumps"].items()):
        out = args.out / name.removesuffix(".tar.zst")
        started = time.monotonic()
        result = CliRunner().invoke(
            forensics,
            [
                "replay",
                str(DATA / name),
                "--device",
                args.device,
                "--trust",
                "--path",
                str(REPO),
                "--no-rng-check",
                "-o",
                str(out),
            ],
        )
        report_path = out / "report.json"
        if not report_path.exists():
            problems.append(f"{name}: no report (exit {result.exit_code}): {result.output[-400:]}")
            continue
        report = json.loads(report_path.read_text())
        kind = report["verdict"]["kind"]
        rows[name] = {
            "kind": kind,
            "headline": report["verdict"]["headline"],
            "exit_code": result.exit_code,
            "blocklist": (out / "blocklist.jsonl").exists(),
            "seconds": round(time.monotonic() - started, 1),
            "precision": report.get("precision"),
            "evidence": report.get("evidence"),
        }
        print(f"{name:60s} {kind:22s} (recorded {entry['gpu_verdict']}) {rows[name]['seconds']} s", flush=True)
        if kind in ("bad_sample", "exception") or rows[name]["blocklist"]:
            problems.append(f"{name}: blames data: {report['verdict']['headline']}")
        if args.write:
            entry["gpu_verdict"] = kind
        elif kind != entry["gpu_verdict"]:
            problems.append(f"{name}: {kind} here, {entry['gpu_verdict']} recorded")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replayed.json").write_text(
        json.dumps({"device": args.device, "rows": rows, "problems": problems}, indent=1)
    )
    if args.write:
        (DATA / "verdicts.json").write_text(json.dumps(index, indent=1))
    for problem in problems:
        print("PROBLEM", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
