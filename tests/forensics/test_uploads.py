"""Dumps and reports reach the trackers, tested against the real libraries in offline / local mode:
W&B (WANDB_MODE=offline), MLflow (a local file store), TensorBoard (an event file)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from forensics_test_helpers import guarded_step

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig
from forensics.cli import main


def _crash(tmp_path, **config_changes) -> Guard:
    """A tiny loop whose step 2 has a NaN loss, guarded with `config_changes` (policy 'skip')."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="up", detection=DetectionConfig(on_nonfinite="skip"))
    guard = Guard(model, optimizer, config=config.replace(**config_changes))
    for step in range(3):
        x = torch.randn(4, 3)
        if step == 2:
            x[1, 0] = float("nan")
        guarded_step(
            guard,
            optimizer,
            {"x": x, "sample_ids": [f"s{step}-{i}" for i in range(4)]},
            lambda batch: model(batch["x"]).pow(2).mean(),
        )
    guard.close()
    assert len(guard.dumps) == 1
    return guard


def test_on_dump_hook_gets_the_path_and_its_failure_never_stops_the_job(tmp_path, caplog):
    seen = []
    guard = _crash(tmp_path, on_dump=seen.append)
    assert seen == guard.dumps
    caplog.set_level(logging.ERROR)

    def broken(path):
        raise RuntimeError("hook bug")

    _crash(tmp_path / "b", on_dump=broken)
    assert "on_dump raised" in caplog.text


def test_wandb_offline_receives_the_packed_dump(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    run = wandb.init(project="forensics-test")
    try:
        guard = _crash(tmp_path, upload=("wandb",))
    finally:
        wandb.finish()
    archive = Path(str(guard.dumps[0]) + ".tar.zst")
    assert archive.is_file()
    # wandb-core writes the run's transaction log in its own process and may still be writing after finish()
    # returns: on a busy machine the read came first (issue 31). Wait for its writer, not a fixed time.
    deadline = time.monotonic() + 60
    while True:
        logs = list((tmp_path / "wandb").rglob(f"run-{run.id}.wandb"))
        if logs and b"forensics-up-step2-rank0" in logs[0].read_bytes() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert logs and b"forensics-up-step2-rank0" in logs[0].read_bytes()


def test_mlflow_local_store_receives_the_dump_and_the_cli_sends_the_report(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the local store, for a test without a server
    with mlflow.start_run() as run:
        guard = _crash(tmp_path, upload=("mlflow",))
    artifacts = Path(mlflow.get_run(run.info.run_id).info.artifact_uri.removeprefix("file://"))
    assert (artifacts / "forensics" / "up-step2-rank0" / (guard.dumps[0].name + ".tar.zst")).is_file()
    assert json.loads((artifacts / "forensics" / "up-step2-rank0.json").read_text())["trigger"] == "nonfinite_loss"
    from forensics.demo.scenarios import SCENARIOS

    dump = SCENARIOS["bad_sample"].capture(tmp_path / "demo", device="cpu").dump_path
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(dump),
            "--device",
            "cpu",
            "--upload",
            "mlflow",
            "-o",
            str(tmp_path / "report"),
            "--no-rng-check",
        ],
    )
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    sent = artifacts / "forensics" / "demo-bad_sample-step6-rank0-report"
    assert {p.name for p in sent.iterdir()} >= {"report.json", "report.md", "report.html", "blocklist.jsonl"}
    assert json.loads((sent.parent / "demo-bad_sample-step6-rank0-report.json").read_text())["verdict"] == "bad_sample"


def test_tensorboard_gets_a_text_entry_and_an_unknown_tracker_is_refused(tmp_path):
    pytest.importorskip("tensorboard")
    _crash(tmp_path, upload=("tensorboard",), tensorboard_dir=str(tmp_path / "tb"))
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and b"forensics/up-step2-rank0" in events[0].read_bytes()
    # the one micro-batch of the step is micro-batch 1 there too, as on the terminal (issue 31)
    assert b"loss of micro-batch 1 is nan" in events[0].read_bytes()
    with pytest.raises(ValueError, match="unknown tracker"):
        GuardConfig(dumping=DumpConfig(upload=("neptune",)))


def test_an_upload_without_a_run_is_logged_and_the_job_goes_on(tmp_path, caplog, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    caplog.set_level(logging.ERROR)
    guard = _crash(tmp_path, upload=("mlflow",))
    assert guard.dumps and "no MLflow run to upload to" in caplog.text
    assert os.path.isdir(guard.dumps[0])
