"""The run ID every rank of a job agrees on (the dump directory's name), and the device the ranks' collectives use."""

from __future__ import annotations

import datetime
import os

import torch

from forensics.capture.state.source import distributed


def collective_device() -> torch.device:
    """Where the all-reduce's tensor must live for the default process group's backend."""
    if "nccl" in str(torch.distributed.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_run_id() -> str:
    """$FORENSICS_RUN_ID, $TORCHELASTIC_RUN_ID, or a timestamp that rank 0 broadcasts (one start-up collective)."""
    for name in ("FORENSICS_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name) and os.environ[name] != "none":
            return os.environ[name]
    stamp = int(datetime.datetime.now().timestamp())
    if distributed():
        shared = torch.full((1,), stamp, dtype=torch.int64, device=collective_device())
        torch.distributed.broadcast(shared, src=0)
        stamp = int(shared.item())
    return "run-" + datetime.datetime.fromtimestamp(stamp).strftime("%Y%m%d-%H%M%S")


__all__ = ["collective_device", "default_run_id"]
