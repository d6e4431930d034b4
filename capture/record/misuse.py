"""The first check()'s look at how the loop calls the Guard: what would make a dump useless is said at once.

Three mistakes leave a job running with no sign until a crash is dumped and cannot be analysed: check()
without record_batch (no micro-batch to replay), batches whose sample IDs the Guard cannot read (IDs are then
made up from positions: a replay can name a position, never a record to filter), and no record_loss (a NaN
loss is invisible; the trigger can only see the gradient norm). Each is logged once, at the first step, with
the fix. Costs nothing after the first step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from capture.record.incident import StepRecord

log = logging.getLogger(__name__)


def unreadable_ids(batch: Any, sample_id_key: str) -> str:
    """Why the Guard found no sample IDs in `batch` (in words)."""
    if isinstance(batch, Mapping):
        return f"the dict batch has no {sample_id_key!r} key"
    return f"the batch is a {type(batch).__name__}, not a dict with a {sample_id_key!r} key"


class FirstStepCheck:
    """Warns once, at the first check(), about a loop that calls the Guard in a way a dump cannot use."""

    def __init__(self, sample_id_key: str):
        self.sample_id_key = sample_id_key
        self.done = False

    def look(self, record: StepRecord) -> None:
        """The first step's record; later calls return at once. Never raises."""
        if self.done:
            return
        self.done = True
        try:
            self._look(record)
        except Exception:  # advice must never cost the job
            log.debug("forensics: the first-step usage check failed", exc_info=True)

    def _look(self, record: StepRecord) -> None:
        if not record.batches:
            log.warning("forensics: check() was called without guard.record_batch(batch): a fault would be dumped "
                        "with no micro-batch, and there would be nothing to replay. Fix: call "
                        "guard.record_batch(batch) once per micro-batch, after loading it and before its forward "
                        "(README: the four calls)")
            return
        missing = [index for index, ids in enumerate(record.sample_ids) if ids is None]
        if missing:
            why = unreadable_ids(record.batches[missing[0]], self.sample_id_key)
            log.warning("forensics: the Guard cannot read sample IDs from %d of the step's %d micro-batch(es) (%s): a "
                        "dump would name samples by their position in the batch ('step5/rank0/mb0/2'), which no "
                        "blocklist can use. Fix: guard.record_batch(batch, sample_ids=ids) with your dataset's IDs, "
                        "or put them under the batch's %r key (GuardConfig.recording.sample_id_key)",
                        len(missing), len(record.batches), why, self.sample_id_key)
        if not record.losses:
            log.warning("forensics: no loss was recorded at the first step: a NaN loss goes unseen (only the gradient "
                        "norm is watched) and the dump holds no loss to compare a replay with. Fix: call "
                        "guard.record_loss(loss) once per micro-batch, with the loss before dividing it by the "
                        "accumulation steps")
