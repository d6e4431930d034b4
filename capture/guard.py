"""The in-job Guard: records each step's micro-batches and RNG, detects faults, writes the dump, applies policy.

Costs on a healthy step: an RNG snapshot per micro-batch (host only; the Python and numpy states shared while their
generators did not draw), one fused grad-norm reduction when the loop does not pass its own, and exactly one
device->host transfer (inside `check`); tests/capture/test_healthy_cost.py holds the count in CI. Under
torchrun (world size > 1, torch.distributed initialised) add one all-reduce, so that every rank
triggers on the same step (capture/check/agreement.py); framework adapters live in capture.integrations.
GuardConfig(sync_free=True) removes the transfer for fused optimizers (capture/check/sync_free.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

from capture.check.agreement import default_run_id, unwrap_model
from capture.check.detectors import StepDetectors
from capture.check.sync import SyncCheck
from capture.check.sync_free import SyncFree
from capture.check.update import UpdateCheck
from capture.config import GuardConfig
from capture.dump import environment
from capture.dump.dumper import Dumper
from capture.dump.main_script import MainScript
from capture.precursors import monitor
from capture.raised import exceptions
from capture.raised.optimizer_steps import OptimizerSteps
from capture.record.history import History
from capture.record.incident import Incident, StepRecord
from capture.record.misuse import FirstStepCheck
from capture.record.recorder import StepRecorder, loss_value
from capture.record.window import FlightRecorder
from capture.state.host_snapshots import HostSnapshots
from capture.state.recipe import default_loss_fits
from capture.state.source import Ranks, StateSource, state_source
from forensics.errors import TrainingFaultError
from forensics.kinds import Policy

log = logging.getLogger(__name__)

class Guard:
    """Watches a training loop; on NaN/Inf or a spike, writes a replayable dump of the pre-step state.

    Works the same in one process and under torchrun: with several ranks, one all-reduce per step makes
    every rank trigger on the same step (a fault or spike seen by one rank is dumped by all), and a
    SIGTERM that arrives while a rank writes its dump waits until the dump is complete.

    Args:
        model: the module being trained; DDP / DataParallel / torch.compile wrappers are stripped
            (parameter names come from the inner module).
        optimizer, scheduler, scaler: their state goes into the dump (scaler: torch GradScaler).
        config: GuardConfig; defaults raise on NaN/Inf and continue on spikes.
        loss_fn: `(model, batch) -> loss` used for the in-job re-check and named in the replay recipe;
            default `model(**batch).loss`.
        state: builds the state source from (model, optimizer, scheduler, scaler, config, ranks, loss_fn);
            default: capture.state.source.state_source (whole or DTensor). Framework adapters pass theirs.
    Example:
        >>> guard = Guard(model, optimizer, scheduler, config=GuardConfig(dump_dir="dumps"))  # doctest: +SKIP
        >>> for batch in loader:                                                         # doctest: +SKIP
        ...     guard.record_batch(batch)
        ...     loss = model(**batch).loss; guard.record_loss(loss); loss.backward()
        ...     if guard.check(grad_norm=clip_grad_norm_(model.parameters(), 1.0)):
        ...         optimizer.step()
        ...     scheduler.step(); optimizer.zero_grad()

    The stages take what they read, never the Guard: the state source (capture/state/source.py), the checks
    (capture/check/: each returns an Incident or None), the Dumper (capture/dump/dumper.py), the precursor monitor
    and the dump of a step that raised. The Guard dumps each Incident and applies its policy (`handle_incident`).
    Adapters (capture/integrations/) override only `at_step_boundary` and `step_number` and bring a state source.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 scaler: Any = None, *, config: GuardConfig | None = None, loss_fn: Callable | None = None,
                 state: Callable[..., StateSource] = state_source):
        model = unwrap_model(model)
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.config, self.loss_fn = config or GuardConfig(), loss_fn
        ranks = Ranks.here()
        self.rank, self.world_size, self.local_rank = ranks.rank, ranks.world_size, ranks.local_rank
        self.run_id = self.config.run_id or default_run_id()
        self.step = 0
        self.state = state(model, optimizer, scheduler, scaler, self.config, ranks, loss_fn)
        """What the training state is and how it is read (capture/state/source.py)."""
        if self.state.dtensors and self.config.recheck:
            log.warning("forensics: recheck is off for a DTensor (FSDP2 / tensor-parallel) model: a forward on the "
                        "ranks that saw the fault alone would wait forever for the others")
            self.config = self.state.config = dataclasses.replace(self.config, recheck=False)
        self.buffers = self.state.buffers
        self.history = History(self.config.history_size)
        self.window = FlightRecorder(self.config.window_steps)
        """The flight recorder: sample IDs, RNG and scalars of the last window_steps steps (record/window.py)."""
        self.snapshots = HostSnapshots(self.config.snapshot_every, self.config.snapshot_count)
        """Host copies of the state every snapshot_every steps (capture/state/host_snapshots.py)."""
        self.detectors = StepDetectors(self.config)
        self._hooks: list[Any] = []
        self._sync_free = SyncFree(self.config, self.detectors, self.state, self.history, self.add_hook) \
            if self.config.sync_free else None
        recipe = self.state.recipe()
        self.dumper = Dumper(self.config, self.run_id, self.state, self.history, self.window, self.snapshots,
                             MainScript(recipe), on_device_lost=self._device_lost)
        self.dumps: list[Path] = self.dumper.dumps
        """The dumps written so far (background writes appear once complete)."""
        self.dump_errors: list[str] = self.dumper.errors
        """Why a dump was not written, one entry per failed attempt."""
        self.recorder = StepRecorder(self.config.sample_id_key, self._step_starts)
        """The step in progress, as record_batch and record_loss keep it (capture/record/recorder.py)."""
        self.add_hook(model.register_forward_pre_hook(self._note_autocast))
        self.optimizer_steps = OptimizerSteps(optimizer, self.add_hook)
        """Whether the optimizer stepped since the last check() (capture/raised/optimizer_steps.py)."""
        self.first_step = FirstStepCheck(self.config.sample_id_key)
        """Warns once, at the first check(), about calls a dump could not use (capture/record/misuse.py)."""
        self.last_step: StepRecord | None = None
        """The record of the last checked step (a step that raises after check(); verify_update)."""
        self.stopped: TrainingFaultError | None = None
        """The TrainingFaultError check() raised last, until the next step is recorded: an exception raised after it
        outside a recorded step (code after the training loop) is not dumped as the faulted step's."""
        self.last_incident_step: int | None = None
        """The step of the last incident handled (a precursor does not dump a step dumped already)."""
        self.last_dumped_step: int | None = None
        """The step of the last incident admitted for a dump (a precursor then waits for a step not dumped)."""
        self.precursors = monitor.attach(model, optimizer, scaler, self.config.precursors,
                                         sync_free=self.config.sync_free, window=self.window, add_hook=self.add_hook)
        """GuardConfig.precursors: the per-layer statistics monitor (capture/precursors/monitor.py), or None."""
        self._sync_check = SyncCheck(self.config, self.detectors, self.state, self.history, self.window,
                                     self.snapshots, self.precursors)
        environment.environment()  # versions, git commit: read now, not while a fault is being dumped
        if self.config.capture_exceptions:
            exceptions.watch(self)
        unfit = default_loss_fits(model, recipe, self.config.recipe)
        if unfit:
            log.warning("forensics: %s", unfit)
        if self.config.verify_update:
            UpdateCheck(self.config, self.state, self.history, lambda: (self.step - 1, self.last_step),
                        self.handle_incident, self.add_hook)

    # -- recording (hot path: references and host-side RNG only) ---------------------------------
    def record_batch(self, batch: Any, sample_ids: Any = None) -> None:
        """Call once per micro-batch, after it is loaded and before its forward. Never raises."""
        self.recorder.batch(batch, sample_ids)

    def record_loss(self, loss: Any) -> None:
        """Call once per micro-batch with its loss BEFORE any division by the accumulation count.

        Never raises: a tensor is kept by reference (its mean is read at check()); an empty tensor, or a
        value that does not convert to a float (an object whose __float__ raises, a Python int beyond the
        float range such as 10**400), is ignored with a warning. Without record_batch the loss is still
        watched (the step then has no micro-batch to dump: the first check() says so)."""
        value, recorder = loss_value(loss), self.recorder  # inline: the hot path, once per micro-batch
        recorder.current = recorder.current or StepRecord()
        if value is not None:
            recorder.current.losses.append(value)

    def _step_starts(self) -> None:
        self.buffers.take_before_forward()
        self.stopped = None  # the job caught the TrainingFaultError and trains on

    def _note_autocast(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: the autocast state the model actually runs under (read once per step)."""
        current = self.recorder.current
        if current is not None and current.autocast is None:
            current.autocast = environment.autocast_settings()

    # -- the per-step decision -------------------------------------------------------------------
    def check(self, grad_norm: Any = None, step: int | None = None) -> bool:
        """Runs the detectors between backward and optimizer.step().

        Args:
            grad_norm: the total gradient norm the loop already computed (e.g. clip_grad_norm_'s
                return value); computed here in one fused reduction when omitted.
            step: the global step number; default: the framework's (adapters) or an internal counter.
        Returns:
            True to go on with optimizer.step(); False when the step must be skipped (skip policy).
            Always True between gradient-accumulation boundaries of a framework adapter.
        Raises:
            TrainingFaultError: under the 'raise' policy, after the dump is written (or failed to be).
        """
        if not self.at_step_boundary():
            return True
        step = self.step_number() if step is None else step
        if step is not None:
            self.step = step
        record = self.recorder.take()
        self.optimizer_steps.checked()
        self.first_step.look(record)
        sync_free = False
        try:
            sync_free = self._sync_free is not None and self._sync_free.active()
            decision = self._decide(record, grad_norm, sync_free)
        except TrainingFaultError as fault:
            self.last_step = record
            self.stopped = fault  # later exceptions outside a recorded step are not this step's (record_exception)
            self.step += 1  # a job that catches the error and goes on must not reuse this step's number
            raise
        except Exception as exc:  # noqa: BLE001
            if exceptions.is_cuda_error(exc):  # the job's own device fault, surfacing at the step's one sync
                self.recorder.current = record  # dumped as the step that raised; the job fails with its own error
                self.record_exception(exc)  # which ends the step
                raise
            log.exception("forensics: the check of step %d failed inside forensics; training continues", self.step)
            decision = True
        if self.precursors is not None:  # never in the sync-free mode (monitor.attach)
            self._judge_precursors(record, decision)
        if not decision and not sync_free:
            self.buffers.undo_skipped_step(self.step)
        self.last_step = record
        self.step += 1
        return decision

    def _decide(self, record: StepRecord, grad_norm: Any, sync_free: bool) -> bool:
        """This step's check; sync-free: the previous step judged, then this one's copies started (always True: the
        device skipped a bad update itself)."""
        if not sync_free:
            return self._apply(self._sync_check.check(record, grad_norm, self.step))
        self._apply(self._sync_free.resolve(self.step))
        self._sync_free.start(record, grad_norm, self.step)
        return True

    def _apply(self, incident: Incident | None) -> bool:
        return True if incident is None else self.handle_incident(incident)

    def _judge_precursors(self, record: StepRecord, decision: bool) -> None:
        """A precursor that fired in the row this check() read dumps this step (sharded: the next). Never raises."""
        try:
            self._apply(monitor.judge(self.precursors, self.step, record, state=self.state, history=self.history,
                                      healthy=decision and self.last_incident_step != self.step,
                                      dumped=self.last_dumped_step == self.step,
                                      divisor=record.divisor(self.config.loss_divisor)))
        except Exception:  # noqa: BLE001 - capture must never stop a healthy job
            log.exception("forensics: precursors: step %d could not be judged", self.step)

    def handle_incident(self, incident: Incident) -> bool:
        """Dumps the incident (within the caps) and applies its policy.

        Returns:
            False when the step must be skipped ('skip'), else True.
        Raises:
            TrainingFaultError: under 'raise', after the dump was written (or failed to be).
        """
        trigger, policy = incident.trigger, incident.policy
        self.last_incident_step = incident.step
        admission = self.dumper.admit(incident)  # one not dumped is counted and logged once per window there
        if incident.undumpable is None and (admission.why_not is None or policy is not Policy.CONTINUE):
            log.warning("forensics: step %d rank %d: %s (policy: %s)", incident.step, self.rank, trigger.message,
                        policy)
        dump_path, dump_error = self.dumper.dump(incident, admission)
        if admission.why_not is None:
            self.last_dumped_step = incident.step
        if policy is Policy.RAISE:
            where = f"dump written to {dump_path}" if dump_path else f"NO dump was written: {dump_error}"
            raise TrainingFaultError(
                f"step {incident.step}: {trigger.message}; {where}. "
                + (f"Replay it with: forensics replay {dump_path}" if dump_path else ""),
                trigger, dump_path, dump_error)
        return policy is not Policy.SKIP

    def _device_lost(self) -> None:
        """The CUDA context is unusable: sync_free's buffers the device may still write into are never reused."""
        if self._sync_free is not None:
            self._sync_free.quarantine()

    # -- adapter hooks (docs/ARCHITECTURE.md, "Adapter hooks") ------------------------------------
    def at_step_boundary(self) -> bool:
        """True when this check() precedes an optimizer step (adapters: the gradient-accumulation boundary)."""
        return True

    def step_number(self) -> int | None:
        """The framework's global step for this check(), or None to use the Guard's own counter."""
        return None

    # -- a step that raises ----------------------------------------------------------------------
    @contextlib.contextmanager
    def capture_errors(self) -> Iterator["Guard"]:
        """Wrap each training step: if it raises (forward, loss, backward, clipping, the optimizer step), the
        step is dumped — pre-step state, the micro-batches recorded so far and the one in flight, RNG, the
        exception — and the exception goes on (the job fails as it would have).

        Example:
            >>> for micro_batches in loader:            # doctest: +SKIP
            ...     with guard.capture_errors():
            ...         ...  # record_batch, forward, record_loss, backward, check, optimizer.step()
        """
        try:
            yield self
        except Exception as exc:  # noqa: BLE001 - recorded, then re-raised unchanged
            self.record_exception(exc)
            raise

    def record_exception(self, exc: BaseException) -> Path | None:
        """Dumps the step in progress because it raised `exc` (`capture_errors()`, the excepthook and the
        Lightning callback call this). Never raises; returns the dump's path, or None.

        Raised after check(), the optimizer's step hooks tell where: inside the update (the manifest says
        `state_may_be_partial`) or after it, between steps (capture/raised/exceptions.py `raised_incident`).
        """
        try:
            incident = exceptions.raised_incident(
                exc, self.recorder.current, step=self.step, last_step=self.last_step, stopped=self.stopped,
                optimizer_steps=self.optimizer_steps, state=self.state, loss_divisor=self.config.loss_divisor)
            path, error = self.dumper.dump(incident) if incident is not None else (None, None)
            if error:
                log.error("forensics: no dump of the step that raised: %s", error)
            return path
        except Exception:  # noqa: BLE001 - the job is already failing: never add a second error
            log.exception("forensics: dumping the step that raised %s failed", type(exc).__name__)
            return None
        finally:
            self.recorder.current = None  # the step is over; a job that catches the error starts the next one afresh

    # -- lifecycle -------------------------------------------------------------------------------
    def add_hook(self, handle: Any) -> None:
        """Keeps a removable hook handle; close() removes it."""
        self._hooks.append(handle)

    def flush(self) -> None:
        """GuardConfig.sync_free: judges the last checked step now (dump, policy); a no-op otherwise.

        Raises:
            TrainingFaultError: under the 'raise' policy, when that step was non-finite.
        """
        try:
            if self._sync_free is not None:
                self._apply(self._sync_free.resolve(self.step))
        except TrainingFaultError:
            raise
        except Exception:  # noqa: BLE001
            log.exception("forensics: judging the last step failed inside forensics")

    def close(self, timeout: float | None = None) -> None:
        """Judges a step still pending (sync_free), waits for background dump writes, removes the hooks."""
        try:
            self.flush()
        finally:
            exceptions.unwatch(self)
            self.dumper.join(timeout)
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
