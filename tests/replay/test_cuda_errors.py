"""A real device-side assert on a GPU (skipped without CUDA): the job fails with its own error (no abort), the
dump holds what the host held (sample IDs, RNG, history, the last host snapshot whose copy had landed), and
`forensics replay` in a fresh process names the sample and the token id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forensics.format import open_dump, verify_dump

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "replay" / "device_assert_job.py"
BAD = (5 * 2 + 1) * 4 + 2  # step 5, micro-batch 1, row 2 of token_job's data


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def test_device_side_assert_dumps_the_host_side_and_replays_to_the_sample_and_token(tmp_path):
    job = subprocess.run(
        [sys.executable, str(JOB), str(tmp_path / "dumps")], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert job.returncode == 1, (job.returncode, job.stderr[-3000:])  # the job's own error; not 134 (abort)
    assert "terminate called" not in job.stderr and "device-side assert" in job.stderr, job.stderr[-3000:]
    (path,) = sorted((tmp_path / "dumps" / "assert").glob("step-*/rank-*"))
    dump = open_dump(path)
    assert dump.step == 5 and dump.manifest["exception"]["cuda_error"] is True
    assert "CUDA context is unusable" in dump.state_missing and dump.snapshot_step == 2
    assert dump.sample_ids(1) == [BAD - 2, BAD - 1, BAD, BAD + 1] and verify_dump(path).ok

    out = tmp_path / "report"
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "forensics.cli",
            "replay",
            str(path),
            "--trust",
            "--path",
            str(REPO / "tests" / "replay"),
            "--device",
            "cuda:0",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "exception" and report["reproduced"] is True
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [BAD]
    assert report["exception"]["bad_values"][0]["value"] == 300


def test_a_real_cuda_out_of_memory_from_one_long_sample_names_it_by_its_size(tmp_path):
    """One 100,000-token sample in a dynamically padded micro-batch on cuda:0: its eager attention needs hundreds
    of GB, so the allocation fails on any GPU. The dump carries the memory picture; replay names the sample by size."""
    job = subprocess.run(
        [sys.executable, str(REPO / "tests" / "replay" / "oom_job.py"), str(tmp_path / "dumps"), "cuda:0"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert job.returncode == 1 and "OutOfMemoryError" in job.stderr, job.stderr[-3000:]
    path = tmp_path / "dumps" / "oom" / "step-000000002"
    dump = open_dump(path)
    assert dump.manifest["exception"]["memory"]["micro_batches"][1]["shapes"]["input_ids"] == [4, 100_000]
    out = tmp_path / "report"
    replay = subprocess.run(
        [sys.executable, "-m", "forensics.cli", "replay", str(path), "--device", "cuda:0", "-o", str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "exception"
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["doc-2-1-1"]
