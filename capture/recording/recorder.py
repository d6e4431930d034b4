"""What Guard.record_batch and Guard.record_loss keep of the step in progress: references and host-side RNG only.

The hot path of a healthy step: no tensor is copied, no device is synchronised. check() takes the step's record.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable

import torch

from forensics.capture.recording.incident import StepRecord
from forensics.format.limits import MAX_MICRO_BATCHES
from forensics.core.rng import RngCapture

log = logging.getLogger(__name__)


def loss_value(loss: Any) -> torch.Tensor | float | None:
    """What record_loss keeps of `loss` (None: nothing, with a warning). Never raises."""
    try:
        if isinstance(loss, torch.Tensor):
            if loss.numel() == 0:
                log.warning("forensics: record_loss got an empty tensor (no loss); ignored")
                return None
            return loss.detach()
        return float(loss)
    except Exception as exc:  # noqa: BLE001 - capture must never break the job
        log.warning(
            "forensics: record_loss got %s, which does not convert to a number (%s); ignored",
            type(loss).__name__,
            type(exc).__name__,
        )
        return None


class StepRecorder:
    """The step in progress (`current`), built by `batch` (and Guard.record_loss) and taken by check().

    Args:
        sample_id_key: the batch field holding the samples' IDs (a dict batch).
        on_step_start: called at a step's first record_batch, before its first forward (the Guard copies the
            model's buffers then).
    """

    def __init__(self, sample_id_key: str, on_step_start: Callable[[], None]):
        self.sample_id_key, self.on_step_start = sample_id_key, on_step_start
        self.current: StepRecord | None = None
        self._capture_rng = RngCapture()

    def batch(self, batch: Any, sample_ids: Any = None) -> None:
        """One micro-batch, its sample IDs and the RNG before its forward. Never raises (a step above
        MAX_MICRO_BATCHES micro-batches means check() is never called: the rest is not kept)."""
        try:
            if self.current is None:
                self.current = StepRecord()
                self.on_step_start()
            record = self.current
            if len(record.batches) >= MAX_MICRO_BATCHES:
                return
            if sample_ids is None and isinstance(batch, Mapping):
                sample_ids = batch.get(self.sample_id_key)
            record.batches.append(batch)
            record.sample_ids.append(sample_ids)
            record.rng.append(self._capture_rng())
        except Exception:  # capture must never break the job
            log.exception("forensics: record_batch failed; this step will not be capturable")

    def note_autocast(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook on the model: the autocast state the step actually runs under (read once per step)."""
        if self.current is not None and self.current.autocast is None:
            self.current.autocast = autocast_settings()


def autocast_settings() -> dict:
    """The autocast state active right now (called from inside the user's forward context)."""
    for device_type in ("cuda", "cpu"):
        try:
            enabled = torch.is_autocast_enabled(device_type)
        except TypeError:  # torch < 2.4 has no device argument
            enabled = torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()
        if enabled:
            try:
                dtype = torch.get_autocast_dtype(device_type)
            except (AttributeError, TypeError):
                dtype = torch.get_autocast_gpu_dtype() if device_type == "cuda" else torch.get_autocast_cpu_dtype()
            return {"enabled": True, "device_type": device_type, "dtype": str(dtype).removeprefix("torch.")}
    return {"enabled": False, "device_type": None, "dtype": None}
