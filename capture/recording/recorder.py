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

MAX_DUPLICATE_WARNINGS = 10
"""Steps with a duplicate sample ID warned of: a loader that always repeats IDs says so ten times, not every step."""


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
        self.duplicate_steps = 0
        """Steps whose sample IDs named two samples (warned for the first MAX_DUPLICATE_WARNINGS)."""

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
            if sample_ids is None and (isinstance(batch, dict) or isinstance(batch, Mapping)):  # dict: no ABC check
                sample_ids = batch.get(self.sample_id_key)
            record.batches.append(batch)
            record.sample_ids.append(sample_ids)
            record.rng.append(self._capture_rng())
        except Exception:  # capture must never break the job
            log.exception("forensics: record_batch failed; this step will not be capturable")
            return
        try:
            self._note_duplicates(record, sample_ids)
        except Exception:  # capture never breaks the job: an ID that compares oddly costs the warning only
            log.debug("forensics: the sample IDs could not be compared", exc_info=True)

    def _note_duplicates(self, record: StepRecord, sample_ids: Any) -> None:
        """Warns (once per step, for the first MAX_DUPLICATE_WARNINGS such steps) when a sample ID names two samples
        of the step: a replay blames positions, and a blocklist entry for that ID would drop the innocent one too.
        Host values only: IDs in a device tensor are compared by the replay (reading them here would synchronise)."""
        if record.duplicate_id or sample_ids is None or self.duplicate_steps >= MAX_DUPLICATE_WARNINGS:
            return
        if isinstance(sample_ids, torch.Tensor):
            if sample_ids.device.type != "cpu" or sample_ids.dim() != 1:
                return
            sample_ids = sample_ids.tolist()
        if not isinstance(sample_ids, (list, tuple)):
            return
        try:
            ids = set(sample_ids)  # one pass in C: the healthy step's whole cost
        except TypeError:  # an unhashable ID (a dict): not compared
            return
        seen = record.seen_ids  # never holds None (a sample without an ID repeats no one's)
        if len(ids) == len(sample_ids) and seen.isdisjoint(ids):
            seen |= ids
            seen.discard(None)
            return
        ids.discard(None)
        repeat = _first_repeat(sample_ids, set(seen))
        seen |= ids
        if repeat is None:  # only several samples without an ID
            return
        index, sid = repeat
        record.duplicate_id = True
        self.duplicate_steps += 1
        log.warning(
            "forensics: sample ID %s names more than one sample of this step (again at micro-batch %d, position %d): "
            "a replay blames samples by position and leaves an ID shared with a healthy sample out of its "
            "blocklist. Give each record its own ID%s",
            repr(sid)[:80],
            len(record.batches),  # counted from 1, as the report counts micro-batches
            index,
            " (not repeated for later steps)" if self.duplicate_steps == MAX_DUPLICATE_WARNINGS else "",
        )

    def note_autocast(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook on the model: the autocast state the step actually runs under (read once per step)."""
        if self.current is not None and self.current.autocast is None:
            self.current.autocast = autocast_settings()


def _first_repeat(sample_ids: list | tuple, earlier: set) -> tuple[int, Any] | None:
    """The position and ID of the first sample whose ID `earlier` (or an earlier sample of the list) holds."""
    for index, sid in enumerate(sample_ids):
        if sid is None:
            continue
        if sid in earlier:
            return index, sid
        earlier.add(sid)
    return None


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
