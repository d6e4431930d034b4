"""A spike dump still being written when the job ends is finished, not lost (issue 30, item 4): at interpreter exit
(concurrent.futures refuses new work by then) and on SIGTERM (the job still ends by SIGTERM); no empty step directory
is left (tests/capture/exit_job.py is the job). Further signals during that flush or during a synchronous write
(issue 43: SIGTERM twice, SIGTERM then Ctrl-C) are held until the dump is written, then end the job as they would
have."""

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
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("exit_job.py")), str(tmp_path), how],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
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
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("exit_job.py")), str(tmp_path), "nan_last"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    dump = tmp_path / "ending" / "step-000000007" / "rank-00000"
    assert verify_dump(dump).ok and open_dump(dump).trigger.kind.value == "nonfinite_loss", done.stderr[-3000:]
    assert "step 7: loss of micro-batch 1 is nan" in done.stderr and "one step late" in done.stderr


@pytest.mark.parametrize(
    "how, signals, ends_by",
    [
        ("flush_sigterm", "TERM,TERM", signal.SIGTERM),  # a scheduler's SIGTERM repeated 0.2 s later
        ("flush_exit", "TERM,INT", signal.SIGTERM),  # SIGTERM then Ctrl-C while the exit waits for the spike dump
        (
            "sync_nan",
            "INT",
            signal.SIGINT,
        ),  # Ctrl-C during the synchronous write of a NaN step: KeyboardInterrupt after
        pytest.param("flush_sigterm", "TERM,INT,INT", signal.SIGTERM, marks=pytest.mark.slow),
        pytest.param("sync_nan", "TERM,TERM", signal.SIGTERM, marks=pytest.mark.slow),
    ],
)
def test_signals_during_a_dump_write_wait_for_it_then_end_the_job(tmp_path, how, signals, ends_by):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("exit_job.py")), str(tmp_path), how, signals],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -ends_by, (done.returncode, done.stderr[-3000:])
    step = tmp_path / "ending" / "step-000000007"
    assert [p.name for p in step.iterdir()] == ["rank-00000"], done.stderr[-3000:]  # no .tmp-* beside it
    assert verify_dump(step / "rank-00000").ok
    assert open_dump(step / "rank-00000").trigger.kind == ("nonfinite_loss" if how == "sync_nan" else "loss_spike")
    assert "finishing the dump first" in done.stderr
    assert how == "sync_nan" or "the dump(s) are written" in done.stderr  # said before the signal ends the job


def test_a_flush_whose_dump_fails_for_want_of_space_does_not_say_it_was_written(tmp_path, helpers, caplog):
    """The file-size limit makes the background write fail as a full disk does; the exit flush then says that the
    dump could not be written, never "the dump(s) are written" right after "no dump written"."""
    import logging
    import resource
    import threading

    from forensics.capture.dumping.writer_thread import BackgroundWriter

    content, _ = helpers.synthetic_content()
    copied = threading.Event()
    content.ready = copied.wait  # the write starts once the flush is waiting for it
    writer, errors = BackgroundWriter(), []
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        writer.submit(content, str(tmp_path), lambda path: None, errors.append)
        threading.Timer(0.2, copied.set).start()
        with caplog.at_level(logging.WARNING, logger="forensics.capture.dumping.writer_thread"):
            writer.finish("the job is exiting")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert len(errors) == 1 and "no dump written" in errors[0]
    assert "1 of the 1 dump(s) could not be written" in caplog.text and "are written" not in caplog.text
