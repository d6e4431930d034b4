"""Measures what CUDA_LAUNCH_BLOCKING=1 changes for a device-side assert (GPU only): runs
tests/replay/device_assert_job.py with and without it and prints, for each, where the dumped exception points
(phase and innermost frame) and how long the job's healthy steps took.

    python -m scripts.check_launch_blocking
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from forensics.format import open_dump

REPO = Path(__file__).resolve().parents[1]


def run(blocking: bool) -> dict:
    out = tempfile.mkdtemp()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_LAUNCH_BLOCKING", None)
    if blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    job = subprocess.run(
        [sys.executable, str(REPO / "tests" / "replay" / "device_assert_job.py"), out],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    times = [float(t) for t in re.findall(r"step \d+ t=([0-9.]+)", job.stdout)]
    dumps = sorted(Path(out).glob("assert/step-*/rank-*"))
    exception = open_dump(dumps[0]).manifest["exception"] if dumps else {}
    frame = (exception.get("frames") or [{}])[-1]
    return {
        "CUDA_LAUNCH_BLOCKING": int(blocking),
        "exit": job.returncode,
        "dumped": bool(dumps),
        "during": exception.get("during"),
        "innermost_frame": f"{Path(str(frame.get('file'))).name}:{frame.get('function')}",
        "seconds_per_healthy_step": round((times[-1] - times[0]) / (len(times) - 1), 4) if len(times) > 1 else None,
    }


if __name__ == "__main__":
    rows = [run(False), run(True)]
    for row in rows:
        print(json.dumps(row))
