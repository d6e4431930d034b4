"""Reads the log of `torchrun ... tests/replay/device_assert_job.py` and prints how long the healthy rank went on
after the faulting rank's last step began (its wait for the dead peer, until torchrun ended the job)."""

from __future__ import annotations

import re
import sys


def main(path: str) -> None:
    text = open(path, errors="replace").read()
    steps = [(int(r), float(t)) for r, t in re.findall(r"forensics-job: rank (\d+) step \d+ t=([0-9.]+)", text)]
    ends = [float(t) for t in re.findall(r"forensics-job-exit t=([0-9.]+)", text)]
    if not steps:
        print("device_assert_2gpu: no step lines in the log")
        return
    last_step = max(t for _, t in steps)
    end = max(ends) if ends else None
    print(
        f"device_assert_2gpu: the job ended {end - last_step:.1f} s after the last step began"
        if end
        else "device_assert_2gpu: no end time recorded"
    )


if __name__ == "__main__":
    main(sys.argv[1])
