"""Runs every planted-fault scenario (capture + replay) on one device and compares the report with the
scenario's expected answer; prints one row per scenario. Used for the GPU acceptance run:
    python -m scripts.check_scenarios --device cuda:0
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from forensics.demo.scenarios import SCENARIOS
from forensics.replay.engine import ReplayOptions, run_replay


def compare(report: dict, expected) -> list[str]:
    culprit = report["culprit"]
    got = {
        "verdict": report["verdict"]["kind"],
        "reproduced": report["reproduced"],
        "samples": sorted(str(s["sample_id"]) for s in culprit["samples"]),
        "module": culprit.get("module"),
        "op": culprit.get("op"),
        "phase": culprit.get("phase"),
        "parameter": culprit.get("parameter"),
    }
    wrong = []
    if got["verdict"] != expected.verdict:
        wrong.append(f"verdict {got['verdict']} != {expected.verdict}")
    if got["reproduced"] != expected.reproduced:
        wrong.append(f"reproduced {got['reproduced']} != {expected.reproduced}")
    if expected.samples and got["samples"] != sorted(map(str, expected.samples)):
        wrong.append(f"samples {got['samples']} != {sorted(map(str, expected.samples))}")
    for key in ("module", "op", "phase", "parameter"):
        want = getattr(expected, key)
        if want is not None and got[key] != want:
            wrong.append(f"{key} {got[key]} != {want}")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    rows = []
    for name, scenario in SCENARIOS.items():
        start = time.perf_counter()
        try:
            captured = scenario.capture(tempfile.mkdtemp(), device=args.device)
            report = run_replay(captured.dump_path, ReplayOptions(device=args.device))
            wrong = compare(report, captured.expected)
            culprit = report["culprit"]
            row = {
                "scenario": name,
                "ok": not wrong,
                "problems": wrong,
                "verdict": report["verdict"]["kind"],
                "samples": [s["sample_id"] for s in culprit["samples"]],
                "module": culprit.get("module"),
                "op": culprit.get("op"),
                "phase": culprit.get("phase"),
                "fidelity": report["fidelity"].get("mode"),
                "bitwise": report["fidelity"].get("bitwise_equal"),
            }
        except Exception as exc:  # noqa: BLE001 - one broken scenario must not hide the others
            row = {"scenario": name, "ok": False, "problems": [f"{type(exc).__name__}: {exc}"]}
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} scenarios give the expected answer on {args.device}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
