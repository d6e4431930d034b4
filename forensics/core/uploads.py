"""Sending a dump (packed) or a report to an experiment tracker: Weights & Biases, MLflow, TensorBoard.

Used by the Guard after a dump is written (`DumpConfig(upload=("wandb",))`, to the tracker run the job
has open) and by `forensics replay --upload ...` for the report (to the run named by the tracker's own
environment: WANDB_RUN_ID / WANDB_PROJECT, MLFLOW_RUN_ID / MLFLOW_TRACKING_URI). Each tracker is an
optional extra (`pip install 'forensics[wandb]'`, `[mlflow]`, `[tensorboard]`), imported only when named.

| tracker | what is sent |
|---|---|
| `wandb` | an Artifact of type `forensics-dump` / `forensics-report` holding the files, with the summary as metadata |
| `mlflow` | the files under `forensics/<name>/` of the run's artifacts, and the summary as `forensics/<name>.json` |
| `tensorboard` | a text entry `forensics/<name>` (trigger, step, where the files are): TensorBoard keeps no files |
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from forensics.core.errors import ForensicsError
from forensics.core.kinds import Tracker

TRACKERS = Tracker.values()


class UploadError(ForensicsError):
    """A tracker is not installed, has no run to log to, or refused the upload."""


def upload(
    tracker: str,
    files: list[Path],
    name: str,
    kind: str,
    summary: dict,
    tensorboard_dir: str | os.PathLike | None = None,
) -> str:
    """Sends `files` to `tracker` under `name`; returns where they went (for the log).

    Args:
        tracker: one of TRACKERS.
        files: the packed dump, or a report's files.
        name: a plain name, e.g. "run-7-step41217-rank3".
        kind: "dump" or "report".
        summary: small JSON facts (trigger, step, rank, verdict ...).
        tensorboard_dir: the TensorBoard log directory (tensorboard only).
    Raises:
        UploadError: with what to do (install the extra, open a run ...).
    """
    senders: dict[Tracker, Callable[..., str]] = {
        Tracker.WANDB: _wandb,
        Tracker.MLFLOW: _mlflow,
        Tracker.TENSORBOARD: _tensorboard,
    }
    try:
        known = Tracker.parse(tracker)
    except ValueError:
        raise UploadError(f"unknown tracker {tracker!r}; choose from {', '.join(TRACKERS)}") from None
    return senders[known](files, name, kind, summary, tensorboard_dir)


def _import_extra(tracker: Tracker):
    try:
        return __import__(tracker.module, fromlist=["_"])
    except ImportError:
        raise UploadError(f"uploading to {tracker} needs its package: pip install 'forensics[{tracker}]'") from None


def _wandb(files: list[Path], name: str, kind: str, summary: dict, _tb) -> str:
    wandb = _import_extra(Tracker.WANDB)
    run = wandb.run
    if run is None:
        if not os.environ.get("WANDB_RUN_ID"):
            raise UploadError(
                "no W&B run to upload to: call wandb.init() in the job, or set WANDB_RUN_ID "
                "(and WANDB_PROJECT) to attach to an existing run"
            )
        run = wandb.init(resume="allow")
    artifact = wandb.Artifact(f"forensics-{name}", type=f"forensics-{kind}", metadata=summary)
    for path in files:
        artifact.add_file(str(path))
    run.log_artifact(artifact)
    return f"W&B artifact forensics-{name} of run {run.id}"


def _mlflow(files: list[Path], name: str, kind: str, summary: dict, _tb) -> str:
    mlflow = _import_extra(Tracker.MLFLOW)
    started = False
    run = mlflow.active_run()
    if run is None:
        if not os.environ.get("MLFLOW_RUN_ID"):
            raise UploadError(
                "no MLflow run to upload to: call mlflow.start_run() in the job, or set "
                "MLFLOW_RUN_ID to attach to an existing run"
            )
        run, started = mlflow.start_run(), True
    try:
        for path in files:
            mlflow.log_artifact(str(path), artifact_path=f"forensics/{name}")
        mlflow.log_dict(summary, f"forensics/{name}.json")
        mlflow.set_tag(f"forensics.{kind}", name)
    finally:
        if started:
            mlflow.end_run()
    return f"MLflow run {run.info.run_id}, artifacts forensics/{name}/"


def _tensorboard(files: list[Path], name: str, kind: str, summary: dict, log_dir) -> str:
    _import_extra(Tracker.TENSORBOARD)
    from torch.utils.tensorboard import SummaryWriter

    if log_dir is None:
        raise UploadError("TensorBoard needs a log directory: DumpConfig(tensorboard_dir=...) or --tensorboard-dir")
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        lines = [f"forensics {kind} **{name}**", "", "```", json.dumps(summary, indent=1, default=str), "```", ""]
        lines += [f"- `{path}`" for path in files]
        writer.add_text(f"forensics/{name}", "\n".join(lines), global_step=summary.get("step"))
    finally:
        writer.close()
    return f"TensorBoard text forensics/{name} in {log_dir}"
