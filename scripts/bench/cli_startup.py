"""CLI start-up: `forensics inspect / verify / list` on a small dump, against a bare interpreter and
`import torch` measured in the same run (medians of N runs of each, interleaved).

    python -m scripts.bench.cli_startup --dump DUMP_DIR [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _time(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "forensics.cli"]
    commands = {"python -c pass": [sys.executable, "-c", "pass"],
                "python -c 'import torch'": [sys.executable, "-c", "import torch"],
                "forensics inspect": [*cli, "inspect", args.dump],
                "forensics verify": [*cli, "verify", args.dump],
                "forensics list": [*cli, "list", args.dump]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            times[name].append(_time(cmd))
    base = statistics.median(times["python -c pass"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} s | {median / base:.1f}x |")


if __name__ == "__main__":
    main()
