"""A spike dump still being written when the job ends is finished, not lost (issue 30, item 4): at interpreter exit
(concurrent.futures refuses new work by then) and on SIGTERM (the job still ends by SIGTERM); no empty step directory
is left (tests/capture/exit_job.py is the job)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from forensics.format import open_dump, verify_dump

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("how", ["exit", "sigterm"])
def test_a_dump_in_flight_when_the_job_ends_is_written(tmp_path, how):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("exit_job.py")), str(tmp_path), how],
                          env=env, capture_output=True, text=True, timeout=120)
    expected = -signal.SIGTERM if how == "sigterm" else 0
    assert done.returncode == expected, done.stderr[-3000:]
    steps = list((tmp_path / "ending").iterdir())
    assert [p.name for p in steps] == ["step-000000007"], done.stderr[-3000:]
    dump = steps[0] / "rank-00000"
    assert verify_dump(dump).ok and open_dump(dump).trigger.kind == "loss_spike"
    assert "cannot schedule new futures" not in done.stderr and "no dump written" not in done.stderr


def test_a_failed_last_step_the_sync_free_check_had_not_judged_is_dumped_at_exit(tmp_path):
    """Default GuardConfig, fused AdamW: the check of a step is finished at the next one; the job's last step is NaN
    and the script just ends (no guard.close()). The interpreter's exit judges it: the dump is written and the error
    is logged (the job still exits 0: it ended by itself, the update was skipped)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("exit_job.py")), str(tmp_path), "nan_last"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    dump = tmp_path / "ending" / "step-000000007" / "rank-00000"
    assert verify_dump(dump).ok and open_dump(dump).trigger.kind.value == "nonfinite_loss", done.stderr[-3000:]
    assert "step 7: loss of micro-batch 1 is nan" in done.stderr and "one step late" in done.stderr
