"""The in-job Guard: records each step's micro-batches and RNG, detects faults, writes the dump, applies policy.

A healthy step costs an RNG snapshot per micro-batch (host only), one fused grad-norm reduction when the loop passes
none, and no device->host transfer with a fused optimizer in one process (the sync-free check, judged one step later:
capture/detection/sync_free.py), else exactly one (in `check`; tests/capture/test_healthy_cost.py counts both); under
torchrun one all-reduce more, so that every rank triggers on the same step (capture/detection/agreement.py).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import weakref
from typing import Any, Callable, Iterator

import torch

from forensics.format.location import Location
from forensics.capture.state.run_id import default_run_id
from forensics.capture.state.unwrap import unwrap_model
from forensics.capture.config import GuardConfig
from forensics.capture.precursors import monitor
from forensics.capture.raised import exceptions
from forensics.capture.recording.incident import Incident, StepRecord
from forensics.capture.recording.recorder import loss_value
from forensics.capture.stages import build as build_stages
from forensics.capture.state.source import Ranks, StateSource, state_source
from forensics.core.errors import TrainingFaultError
from forensics.core.kinds import Policy

log = logging.getLogger(__name__)


class Guard:
    """Watches a training loop; on NaN/Inf or a spike, writes a replayable dump of the pre-step state.

    The same in one process and under torchrun: with several ranks every rank triggers on the same step (a fault or
    spike one rank sees is dumped by all), and a SIGTERM that arrives while a rank writes waits for its dump.

    Args:
        model: the module being trained (DDP / DataParallel / torch.compile wrappers stripped: parameter names come
            from the inner module).
        optimizer, scheduler, scaler: their state goes into the dump (scaler: torch GradScaler).
        config: GuardConfig; defaults raise on NaN/Inf and continue on spikes.
        loss_fn: `(model, batch) -> loss` for the in-job re-check and the replay recipe; default `model(**batch).loss`.
        state: builds the state source (capture/state/source.py) from (model, optimizer, scheduler, scaler, config,
            ranks, loss_fn); adapters pass theirs (DeepSpeed).
    Example:
        >>> guard = Guard(model, optimizer, scheduler, config=GuardConfig(dump_dir="dumps"))  # doctest: +SKIP
        >>> for batch in loader:                                                         # doctest: +SKIP
        ...     guard.record_batch(batch)
        ...     loss = model(**batch).loss; guard.record_loss(loss); loss.backward()
        ...     if guard.check(grad_norm=clip_grad_norm_(model.parameters(), 1.0)):
        ...         optimizer.step()
        ...     scheduler.step(); optimizer.zero_grad()

    Its stages (state source, checks, Dumper, precursor monitor, a step that raised) take what they read and report
    Incidents; the Guard dumps each and applies its policy (docs/ARCHITECTURE.md, "Capture").
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        config: GuardConfig | None = None,
        loss_fn: Callable | None = None,
        state: Callable[..., StateSource] = state_source,
    ):
        wrapped, model = model, unwrap_model(model)
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        ranks, self.loss_fn, self.step = Ranks.here(), loss_fn, 0
        self.rank, self.world_size, self.local_rank = ranks.rank, ranks.world_size, ranks.local_rank
        self.state = state(model, optimizer, scheduler, scaler, config or GuardConfig(), ranks, loss_fn)
        self.config = config = self.state.config  # a DTensor state turns the in-job re-check off
        self.run_id = config.run_id or default_run_id()
        self.buffers = self.state.buffers
        self._hooks: list[Any] = []
        stages = build_stages(self.state, wrapped, self.run_id, self.handle_incident, self.add_hook, lambda: self.step)
        self.history, self.window, self.snapshots = stages.history, stages.window, stages.snapshots
        self.precursors, self.checks, self.dumper = stages.precursors, stages.checks, stages.dumper
        self.recorder, self.optimizer_steps, self.calls = stages.recorder, stages.optimizer_steps, stages.calls
        self.silent = stages.silent
        self.dumps: list[Location] = self.dumper.dumps  # written so far (a background write once it is complete)
        self.dump_errors: list[str] = self.dumper.errors  # why a dump was not written, one per failed attempt
        self.run_log = self.dumper.run_log  # every step's scalars and event, for `forensics timeline` (or None)
        if config.recording.capture_exceptions:
            exceptions.watch(self)
        self._judge_at_exit = functools.partial(_judge_at_exit, weakref.ref(self))
        if self.checks.sync_free is not None:  # a step judged one step late is still judged when the job just ends
            atexit.register(self._judge_at_exit)

    # -- recording (hot path: references and host-side RNG only) ---------------------------------
    def record_batch(self, batch: Any, sample_ids: Any = None) -> None:
        """Call once per micro-batch, after it is loaded and before its forward. Never raises."""
        if self.silent is not None:
            self.silent.before_batch(self.step, self.recorder.current is None)
        self.recorder.batch(batch, sample_ids)

    def record_loss(self, loss: Any) -> None:
        """Call once per micro-batch with its loss BEFORE any division by the accumulation count.

        Never raises: a tensor is kept by reference (its mean is read at check()); an empty tensor, or a
        value that does not convert to a float (an object whose __float__ raises, a Python int beyond the
        float range such as 10**400), is ignored with a warning. Without record_batch the loss is still
        watched (the step then has no micro-batch to dump: the first check() says so)."""
        value, recorder = loss_value(loss), self.recorder  # inline: the hot path, once per micro-batch
        if self.silent is not None:
            self.silent.note_loss(loss)
        recorder.current = recorder.current or StepRecord()
        if value is not None:
            recorder.current.losses.append(value)

    # -- the per-step decision -------------------------------------------------------------------
    def check(self, grad_norm: Any = None, step: int | None = None) -> bool:
        """Runs the detectors between backward and optimizer.step(): True to go on with optimizer.step(), False when
        the step must be skipped (skip policy); always True between gradient-accumulation boundaries of an adapter.

        Args:
            grad_norm: the total gradient norm the loop already computed (e.g. clip_grad_norm_'s return value);
                computed here in one fused reduction when omitted.
            step: the global step number; default: the framework's (adapters) or an internal counter.
        Raises:
            TrainingFaultError: under the 'raise' policy, after the dump is written (or failed to be).
        """
        if not self.at_step_boundary():
            return True
        if self.recorder.current is None and self.calls.repeats(self.step, self.optimizer_steps.stepped()):
            return self.calls.last_decision  # nothing recorded since the last check, which this one repeats
        step = self.step_number() if step is None else step
        self.step = self.step if step is None else step
        record, self.recorder.current = self.recorder.current or StepRecord(), None  # the next batch starts a step
        self.optimizer_steps.checked()
        self.calls.look(record, self.step)  # the first checks' warnings
        decision = sync_free = True
        handled = False  # an incident's policy was applied: a later failure inside forensics does not undo it
        try:
            sync_free = self.checks.sync_free is not None and self.checks.sync_free.active()  # skipped on the device
            for incident in self.checks.incidents(record, grad_norm, self.step, sync_free):
                # an earlier step's incident (judged late) does not decide this step
                decision = self.handle_incident(incident) or (sync_free and incident.step != self.step)
                handled = True
            if self.silent is not None:  # the sampled step's recompute and the replica check
                decision = (
                    self.silent.judge(record, self.step, self.handle_incident, self.dumper.reported(self.step))
                    and decision
                )
        except TrainingFaultError as fault:
            self.calls.answered(record, False, fault)  # a repeat of this check() must not apply the step; later
            # exceptions outside a recorded step are not this step's (record_exception)
            self.step += 1  # a job that catches the error and goes on must not reuse this step's number
            raise
        except Exception as exc:
            if exceptions.is_cuda_error(exc):  # the job's own device fault, surfacing at the step's one sync
                self.recorder.current = record  # dumped as the step that raised; the job fails with its own error
                self.record_exception(exc)  # which ends the step
                raise
            decided = decision if handled else self.calls.last_decision  # a fault found keeps its policy; else the last
            log.exception(
                "forensics: the check of step %d failed inside forensics; check() returns %s", self.step, decided
            )
            decision = decided
        if self.precursors is not None:  # never in the sync-free mode (monitor.attach)
            healthy, dumped = decision and not self.dumper.reported(self.step), self.dumper.dumped(self.step)
            monitor.judge(
                self.precursors,
                self.step,
                record,
                healthy=healthy,
                dumped=dumped,
                state=self.state,
                history=self.history,
                report=self.handle_incident,
            )
        if not decision:
            self.buffers.undo_skipped_step(self.step)
        self.calls.answered(record, decision)
        self.step += 1
        return decision

    def handle_incident(self, incident: Incident) -> bool:
        """Dumps the incident (within the caps) and applies its policy: False when the step must be skipped ('skip'),
        else True. Raises TrainingFaultError under 'raise', after the dump was written (or failed to be)."""
        trigger, policy = incident.trigger, incident.policy
        try:  # whatever fails in here, the policy below applies (raise raises, skip skips)
            dump_path, dump_error = self.dumper.report(incident)  # within the budgets
        except Exception as exc:  # the Dumper never raises; this is the last line of defence
            log.exception("forensics: dumping step %d failed inside forensics", incident.step)
            dump_path, dump_error = None, f"forensics failed ({type(exc).__name__})"
        if policy is Policy.RAISE:
            where = (
                f"dump written to {dump_path}. Replay it with: {self.dumper.needs.command(dump_path)}"
                if dump_path
                else f"NO dump was written: {dump_error}. "
            )
            raise TrainingFaultError(
                f"step {incident.step}: {trigger.message}; {where}", trigger, dump_path, dump_error
            )
        return policy is not Policy.SKIP

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
        """`with guard.capture_errors():` around each training step (record_batch ... optimizer.step()): if it raises
        (forward, loss, backward, clipping, the optimizer step), the step is dumped — pre-step state, the
        micro-batches so far and the one in flight, RNG, the exception — and the exception goes on."""
        try:
            yield self
        except Exception as exc:  # recorded, then re-raised unchanged
            self.record_exception(exc)
            raise

    def record_exception(self, exc: BaseException) -> Location | None:
        """Dumps the step in progress because it raised `exc` (capture_errors(), the excepthook, Lightning's callback).
        Never raises; returns the dump's path, or None. Raised after check(), the optimizer's step hooks tell where:
        inside the update (`state_may_be_partial`) or after it, between steps (capture/raised/exceptions.py)."""
        if exceptions.is_cuda_error(exc):
            self.checks.device_lost()  # the step judged one step late can no longer be read
        elif not (self.state.ranks.multi_rank and self.config.dumping.shard_replicas > 1):  # (buddy copies: a
            self.judge_pending()  # collective the other ranks would not enter) the step before failed first
        try:
            current, calls = self.recorder.current, self.calls
            incident = exceptions.raised_incident(exc, current, self.step, calls, self.optimizer_steps, self.state)
            path, error = self.dumper.dump(incident) if incident is not None else (None, None)
            if error:
                log.error("forensics: no dump of the step that raised: %s", error)
            return path
        except Exception:  # the job is already failing: never add a second error
            log.exception("forensics: dumping the step that raised %s failed", type(exc).__name__)
            return None
        finally:
            self.recorder.current = None  # the step is over; a job that catches the error starts the next afresh

    # -- lifecycle -------------------------------------------------------------------------------
    def add_hook(self, handle: Any) -> None:
        """Keeps a removable hook handle; close() removes it."""
        self._hooks.append(handle)

    def flush(self) -> None:
        """The sync-free check (by default with a fused optimizer): judges the last checked step now (dump, policy); a
        no-op otherwise. Raises TrainingFaultError under the 'raise' policy, when that step failed."""
        self.checks.flush(self.step, report=self.handle_incident)

    def judge_pending(self) -> None:
        """flush() for a job that is going down anyway (an exception, the interpreter's exit): never raises; a
        TrainingFaultError for the pending step is logged (its dump is written)."""
        try:
            self.flush()
        except TrainingFaultError as fault:
            log.error("forensics: %s", fault)
        except Exception:  # the job is already ending
            log.exception("forensics: judging the last checked step failed")

    def close(self, timeout: float | None = None) -> None:
        """Judges a step still pending (sync-free check), waits for background dump writes, removes the hooks."""
        atexit.unregister(self._judge_at_exit)
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


def _judge_at_exit(guard: "weakref.ref[Guard]") -> None:
    """atexit: a Guard still open judges its last checked step (sync-free: it may be the one that failed)."""
    live = guard()
    if live is not None:
        live.judge_pending()
