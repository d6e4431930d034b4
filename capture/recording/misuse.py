"""The first check()'s look at how the loop calls the Guard: what would make a dump useless is said at once.

Three mistakes leave a job running with no sign until a crash is dumped and cannot be analysed: check()
without record_batch (no micro-batch to replay), batches whose sample IDs the Guard cannot read (IDs are then
made up from positions: a replay can name a position, never a record to filter), and no record_loss (a NaN
loss is invisible; the trigger can only see the gradient norm). Each is logged once, at the first step, with
the fix. Costs nothing after the first step.

LoopOrder catches check() in the wrong place of the loop, from host state only (no device read): before backward
(no parameter has a gradient yet: looked at in the first GRADIENT_LOOKS checks only), and twice for one step (no
batch, loss or optimizer step since the last check: the repeat is ignored, so the step counter does not run double).
A grad norm taken before `scaler.unscale_` is capture/detection/sync.py's (SyncCheck.loop_norm_unscaled).

CheckCalls holds the three for the Guard, and what a repeated check() answers: the last check()'s decision again
(a repeat of a skipped step's check() must not apply it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from forensics.core.errors import TrainingFaultError
from forensics.capture.recording.incident import StepRecord

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
            log.warning(
                "forensics: check() was called without guard.record_batch(batch): a fault would be dumped "
                "with no micro-batch, and there would be nothing to replay. Fix: call "
                "guard.record_batch(batch) once per micro-batch, after loading it and before its forward "
                "(README: the four calls)"
            )
            return
        missing = [index for index, ids in enumerate(record.sample_ids) if ids is None]
        if missing:
            why = unreadable_ids(record.batches[missing[0]], self.sample_id_key)
            log.warning(
                "forensics: the Guard cannot read sample IDs from %d of the step's %d micro-batch(es) (%s): a "
                "dump would name samples by their position in the batch ('step5/rank0/mb1/2'), which no "
                "blocklist can use. Fix: guard.record_batch(batch, sample_ids=ids) with your dataset's IDs, "
                "or put them under the batch's %r key (GuardConfig.recording.sample_id_key)",
                len(missing),
                len(record.batches),
                why,
                self.sample_id_key,
            )
        if not record.losses:
            log.warning(
                "forensics: no loss was recorded at the first step: a NaN loss goes unseen (only the gradient "
                "norm is watched) and the dump holds no loss to compare a replay with. Fix: call "
                "guard.record_loss(loss) once per micro-batch, with the loss before dividing it by the "
                "accumulation steps"
            )


GRADIENT_LOOKS = 2  # the first checks whose parameters' .grad are looked at: a loop that checks before backward
# shows it at once (its gradients are still None at step 0), and a look costs a walk over the parameters


class LoopOrder:
    """Warns once each about check() called in the wrong place of the loop, with what to change.

    Args:
        model: the guarded module (its parameters' .grad are looked at, host only).
        grads_on_parameters: the state keeps gradients on `param.grad` (not DeepSpeed's partitions).
    """

    def __init__(self, model: Any, grads_on_parameters: bool):
        self.model = model
        self.looks = GRADIENT_LOOKS if grads_on_parameters else 0
        self.said: set[str] = set()

    def no_gradients(self, step: int) -> None:
        """check() of `step`: in the first GRADIENT_LOOKS checks, warns when no trainable parameter has a gradient."""
        if self.looks <= 0:
            return
        self.looks -= 1
        try:
            params = [p for p in self.model.parameters() if p.requires_grad]
            if params and all(p.grad is None for p in params) and "no_gradients" not in self.said:
                self.said.add("no_gradients")
                log.warning(
                    "forensics: step %d: check() found no gradients (every parameter's .grad is None): it runs "
                    "before backward(), so it judges none of the step's gradients and a dump records no grad "
                    "norm. Fix: call guard.check() after loss.backward() (and scaler.unscale_ / clipping), "
                    "right before optimizer.step(). Logged once",
                    step,
                )
        except Exception:  # advice must never cost the job
            log.debug("forensics: the gradient look failed", exc_info=True)

    def repeated(self, step: int, last: StepRecord, stepped: bool | None) -> bool:
        """For a check() with nothing recorded since the last one: True when it repeats that check for the same step
        (the last check had a batch or a loss, and the optimizer did not step since: `stepped` False; None: unknown).
        Warns once; the Guard ignores the repeat."""
        if not (last.batches or last.losses) or stepped is not False:
            return False
        if "repeated" not in self.said:
            self.said.add("repeated")
            log.warning(
                "forensics: check() was called again for step %d with no batch, loss or optimizer step since the "
                "last call: the repeat is ignored (it would count a step that did not happen and shift every "
                "step number). Fix: call guard.check() once per optimizer step, between backward and "
                "optimizer.step(). Logged once",
                step,
            )
        return True


class CheckCalls:
    """How the loop calls check(), for the Guard: the first check()'s warnings (FirstStepCheck), a check() misplaced
    or repeated (LoopOrder), and the last check's outcome, which a repeat answers again.

    Args:
        model: the guarded module; sample_id_key: GuardConfig.recording.sample_id_key.
        grads_on_parameters: the state keeps gradients on `param.grad` (not DeepSpeed's partitions).
    """

    def __init__(self, model: Any, sample_id_key: str, grads_on_parameters: bool):
        self.first_step = FirstStepCheck(sample_id_key)  # the first check()'s warnings
        self.loop_order = LoopOrder(model, grads_on_parameters)  # check() misplaced
        self.last_decision = True  # what the last check() returned (a repeated check() returns it again)
        self.last_step: StepRecord | None = None  # the last checked step (raised after check(); verify_update)
        self.stopped: TrainingFaultError | None = None  # what check() raised, until the next check(): raised after
        # it outside a recorded step (code after the training loop), an exception is not dumped as that step's

    def repeats(self, step: int, stepped: bool | None) -> bool:
        """A check() of `step` with nothing recorded since the last one: True when it repeats the last check (the
        optimizer did not step since: `stepped` False; None: unknown); the Guard then returns `last_decision`."""
        return self.last_step is not None and self.loop_order.repeated(step - 1, self.last_step, stepped)

    def look(self, record: StepRecord, step: int) -> None:
        """A check() of `step` begins, with the step's record: the first checks' warnings."""
        self.stopped = None  # a job that caught the last TrainingFaultError trains on
        self.first_step.look(record)
        if self.loop_order.looks:  # the first checks only
            self.loop_order.no_gradients(step)

    def answered(self, record: StepRecord, decision: bool, stopped: TrainingFaultError | None = None) -> None:
        """The check() of `record` returned `decision` (False with `stopped`: it raised that TrainingFaultError)."""
        self.last_step, self.last_decision, self.stopped = record, decision, stopped
