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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from capture.check import sync_free
from capture.check.agreement import default_run_id, dist_info, distributed, unwrap_model
from capture.check.detectors import StepDetectors
from capture.check.sync import SyncCheck
from capture.check.update import UpdateCheck
from capture.config import GuardConfig
from capture.dump import environment
from capture.dump.dumper import Dumper
from capture.dump.main_script import MainScript
from capture.dump.recipe import build_recipe, default_loss_fits
from capture.precursors import monitor
from capture.raised import exceptions
from capture.raised.optimizer_steps import OptimizerSteps
from capture.record.history import History
from capture.record.incident import Incident, StepRecord
from capture.record.misuse import FirstStepCheck
from capture.record.window import FlightRecorder
from capture.state import sharding, snapshot
from capture.state.buffers import PreForwardBuffers
from capture.state.host_snapshots import HostSnapshots
from forensics import thirdparty
from forensics.errors import TrainingFaultError
from forensics.grad_norm import total_grad_norm
from forensics.kinds import Policy, StateLayout
from forensics.rng import RngCapture

log = logging.getLogger(__name__)

MAX_MICRO_BATCHES = 4096  # a step with more micro-batches means check() is never called


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
        log.warning("forensics: record_loss got %s, which does not convert to a number (%s); ignored",
                    type(loss).__name__, type(exc).__name__)
        return None


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
    Example:
        >>> guard = Guard(model, optimizer, scheduler, config=GuardConfig(dump_dir="dumps"))  # doctest: +SKIP
        >>> for batch in loader:                                                         # doctest: +SKIP
        ...     guard.record_batch(batch)
        ...     loss = model(**batch).loss; guard.record_loss(loss); loss.backward()
        ...     if guard.check(grad_norm=clip_grad_norm_(model.parameters(), 1.0)):
        ...         optimizer.step()
        ...     scheduler.step(); optimizer.zero_grad()

    Framework adapters (capture/integrations/) subclass the Guard and override only the methods under
    "adapter hooks" below (docs/ARCHITECTURE.md, "Adapter hooks"). The dump path is capture/dump/dumper.py, the
    synchronous check capture/check/sync.py, the sync-free one capture/check/sync_free.py: each reads the Guard
    through a narrow Protocol.
    """

    sharded_grad_norm = False
    """True when compute_grad_norm() is the norm of this rank's shard only (ZeRO, DTensor models): the
    agreement all-reduce assembles the global norm. A norm the loop passes to check() is the global one."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 scaler: Any = None, *, config: GuardConfig | None = None, loss_fn: Callable | None = None):
        model = unwrap_model(model)
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.config = config or GuardConfig()
        self.loss_fn = loss_fn
        self.rank, self.world_size, self.local_rank = dist_info()
        self.run_id = self.config.run_id or default_run_id()
        self.step = 0
        self.history = History(self.config.history_size)
        self.window = FlightRecorder(self.config.window_steps)
        """The flight recorder: sample IDs, RNG and scalars of the last window_steps steps
        (capture/record/window.py)."""
        self.snapshots = HostSnapshots(self.config.snapshot_every, self.config.snapshot_count)
        """Host copies of the state every snapshot_every steps (capture/state/host_snapshots.py)."""
        self.buffers = PreForwardBuffers(model)
        """The model's buffers before the step's first forward (capture/state/buffers.py): dumped, restored on skip."""
        self.dtensors = sharding.has_dtensors(model)
        """The model holds DTensors (FSDP2, tensor parallel): state is written from local shards."""
        self.fsdp_units = sharding.fsdp_units(model) if self.dtensors else []
        """FSDP2 units and their mixed-precision policies (the manifest's precision.fsdp)."""
        if self.dtensors and self.config.recheck:
            log.warning("forensics: recheck is off for a DTensor (FSDP2 / tensor-parallel) model: a forward on the "
                        "ranks that saw the fault alone would wait forever for the others")
            self.config = dataclasses.replace(self.config, recheck=False)
        self.sharded_grad_norm = type(self).sharded_grad_norm or self.dtensors
        self.own_norm_unscaled = False
        """The last compute_grad_norm() divided the loss scale out of gradients a scaler still held scaled."""
        self.layout_used: StateLayout | None = None
        """The state layout of the last dump (GuardConfig.state_layout resolved)."""
        self.detectors = StepDetectors(self.config)
        recipe = build_recipe(model, loss_fn, self.config.sample_id_key, self.config.recipe)
        self.dumper = Dumper(self, MainScript(recipe))
        self.dumps: list[Path] = self.dumper.dumps
        """The dumps written so far (background writes appear once complete)."""
        self.dump_errors: list[str] = self.dumper.errors
        """Why a dump was not written, one entry per failed attempt."""
        self._current: StepRecord | None = None
        self._capture_rng = RngCapture()
        self._hooks: list[Any] = []
        self.add_hook(model.register_forward_pre_hook(self._note_autocast))
        self.optimizer_steps = OptimizerSteps(optimizer, self.add_hook)
        """Whether the optimizer stepped since the last check() (capture/raised/optimizer_steps.py)."""
        self.first_step = FirstStepCheck(self.config.sample_id_key)
        """Warns once, at the first check(), about calls a dump could not use (capture/record/misuse.py)."""
        self.last_step: StepRecord | None = None
        """The record of the last checked step (a step that raises after check(); verify_update)."""
        self._sync_check = SyncCheck(self)
        self._sync_free = sync_free.SyncFree(self) if self.config.sync_free else None
        self.stopped: TrainingFaultError | None = None
        """The TrainingFaultError check() raised last, until the next step is recorded: an exception raised after it
        outside a recorded step (code after the training loop) is not dumped as the faulted step's."""
        self.last_incident_step: int | None = None
        self.last_dumped_step: int | None = None
        """The step of the last incident admitted for a dump (a precursor then waits for a step not dumped)."""
        """The step of the last incident handled (a precursor does not dump a step dumped already)."""
        self.precursors = monitor.attach(self, self.config.precursors)
        """GuardConfig.precursors: the per-layer statistics monitor (capture/precursors/monitor.py), or None."""
        environment.environment()  # versions, git commit: read now, not while a fault is being dumped
        if self.config.capture_exceptions:
            exceptions.watch(self)
        unfit = default_loss_fits(model, recipe, self.config.recipe)
        if unfit:
            log.warning("forensics: %s", unfit)
        if self.config.verify_update:
            UpdateCheck(self)  # installs its optimizer step hooks through add_hook

    # -- recording (hot path: references and host-side RNG only) ---------------------------------
    def record_batch(self, batch: Any, sample_ids: Any = None) -> None:
        """Call once per micro-batch, after it is loaded and before its forward."""
        try:
            if self._current is None:
                self._current = StepRecord()
                self.buffers.take_before_forward()
                self.stopped = None  # the job caught the TrainingFaultError and trains on
            record = self._current
            if len(record.batches) >= MAX_MICRO_BATCHES:
                return
            if sample_ids is None and isinstance(batch, Mapping):
                sample_ids = batch.get(self.config.sample_id_key)
            record.batches.append(batch)
            record.sample_ids.append(sample_ids)
            record.rng.append(self._capture_rng())
        except Exception:  # capture must never break the job
            log.exception("forensics: record_batch failed; this step will not be capturable")

    def record_loss(self, loss: Any) -> None:
        """Call once per micro-batch with its loss BEFORE any division by the accumulation count.

        Never raises: a tensor is kept by reference (its mean is read at check()); an empty tensor, or a
        value that does not convert to a float (an object whose __float__ raises, a Python int beyond the
        float range such as 10**400), is ignored with a warning. Without record_batch the loss is still
        watched (the step then has no micro-batch to dump: the first check() says so)."""
        value = loss_value(loss)
        self._current = self._current or StepRecord()
        if value is not None:
            self._current.losses.append(value)

    def _note_autocast(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: the autocast state the model actually runs under (read once per step)."""
        if self._current is not None and self._current.autocast is None:
            self._current.autocast = environment.autocast_settings()

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
        record, self._current = self._current or StepRecord(), None
        self.optimizer_steps.checked()
        self.first_step.look(record)
        try:
            sync_free = self._sync_free is not None and self._sync_free.active()
            checker = self._sync_free if sync_free and self._sync_free is not None else self._sync_check
            decision = checker.check(record, grad_norm)
        except TrainingFaultError as fault:
            self.last_step = record
            self.stopped = fault  # later exceptions outside a recorded step are not this step's (record_exception)
            self.step += 1  # a job that catches the error and goes on must not reuse this step's number
            raise
        except Exception as exc:
            if exceptions.is_cuda_error(exc):  # the job's own device fault, surfacing at the step's one sync
                self._current = record  # dumped as the step that raised; the job fails with its own error
                self.record_exception(exc)  # which ends the step (self._current = None)
                raise
            log.exception("forensics: the check of step %d failed inside forensics; training continues", self.step)
            decision = True
        if self.precursors is not None:
            monitor.watch(self, record, decision, sync_free)
        if not decision and not sync_free:
            self.buffers.undo_skipped_step(self.step)
        self.last_step = record
        self.step += 1
        return decision

    # -- adapter hooks (see the class docstring) -------------------------------------------------
    def at_step_boundary(self) -> bool:
        """True when this check() precedes an optimizer step (adapters: the gradient-accumulation boundary)."""
        return True

    def step_number(self) -> int | None:
        """The framework's global step for this check(), or None to use the Guard's own counter."""
        return None

    def compute_grad_norm(self) -> torch.Tensor | float | None:
        """The gradient norm of this step when the loop passed none (None: no gradients); for a DTensor model,
        the norm of this rank's shards (sharded_grad_norm). Always unscaled: gradients a GradScaler still holds
        scaled (check() before `scaler.unscale_`) are measured divided by its scale (its device tensor, no sync),
        and `own_norm_unscaled` says so (the manifest's `loss.grad_norm_unscaled_by`)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = sharding.shard_grad_norm(grads) if self.dtensors else total_grad_norm(grads)
        scale = thirdparty.grads_scaled_by(self.scaler, self.optimizer)  # before scaler.unscale_: grads x scale
        self.own_norm_unscaled = False
        if scale is not None and norm is not None:  # one unit everywhere: the norm clip_grad_norm_ sees after unscale_
            self.own_norm_unscaled = True
            norm = norm / scale.reshape(()).to(norm.device) if isinstance(norm, torch.Tensor) else norm / float(scale)
        return norm

    def collect_state(self, copy: snapshot.HostCopy) -> dict:
        """Name-keyed pre-step state: `{"model": {name: tensor}, "optimizer": {...}}` (docs/DUMP_FORMAT.md), the
        full state, or, in the sharded layout (GuardConfig.state_layout), this rank's part of it plus
        `"layout"`, the table of the complete state. Tensors go through `copy` (a no-op unless the dump is
        written in the background)."""
        full_form = self._state_references()
        self.layout_used = self._choose_layout(full_form)
        if self.layout_used is StateLayout.SHARDED:
            state, table = sharding.shard_state(full_form, self.rank, self.world_size, self.config.shard_replicas,
                                                copy)
            return {**state, "layout": table}
        return sharding.full_state(full_form, copy)

    def _state_references(self) -> dict:
        """The state as references (DTensors as they are): nothing copied or gathered yet. An FSDP2 model is
        resharded first (local, no communication): a step that raised mid-forward leaves some modules'
        parameters gathered, and the dump holds each rank's shards."""
        if self.dtensors:
            sharding.reshard(self.model)
        model = snapshot.model_state(self.model, torch.Tensor.detach)
        model.update({name: value for name, value in self.buffers.before().items() if name in model})
        return {"model": model, "optimizer": snapshot.optimizer_state(self.optimizer, self.model, torch.Tensor.detach)}

    def snapshot_state(self) -> dict | None:
        """The state a host snapshot copies (references, full layout), or None after turning snapshots off with
        the reason: a sharded state is not snapshotted."""
        if self.dtensors:
            self.snapshots.turn_off("the model is sharded (FSDP2 / tensor parallel)")
            return None
        full_form = self._state_references()
        if self._choose_layout(full_form) is StateLayout.SHARDED:
            self.snapshots.turn_off("the state is written sharded across ranks (GuardConfig.state_layout)")
            return None
        return full_form

    def _choose_layout(self, full_form: dict) -> StateLayout:
        return sharding.choose_layout(StateLayout(self.config.state_layout), self.world_size if self.multi_rank else 1,
                                      self.dtensors, sharding.state_bytes(full_form), self.config.full_state_max_bytes)

    def replay_recipe(self) -> dict:
        """The manifest's `recipe`: import paths of the model factory and loss, never executed here."""
        return build_recipe(self.model, self.loss_fn, self.config.sample_id_key, self.config.recipe)

    def describe_distribution(self) -> dict | None:
        """The manifest's optional `distributed` section (None: omitted; several ranks: world size and layout)."""
        return {"framework": "torch", "world_size": self.world_size, "dtensor": self.dtensors,
                "state": self.state_words()} if self.multi_rank else None

    def state_words(self) -> str:
        """How the last dump's state was written, in words (the `distributed.state` field)."""
        return sharding.layout_words(self.layout_used)

    @property
    def state_is_collective(self) -> bool:
        """True when collect_state() is a collective (ZeRO gathers, DTensors written whole): then a step that
        raised on one rank is not dumped (the other ranks would never join the gather)."""
        if not (self.dtensors and self.multi_rank):
            return False
        full_form = self._state_references()
        return self._choose_layout(full_form) is StateLayout.FULL or sharding.needs_collective(full_form)

    @property
    def dump_needs_every_rank(self) -> bool:
        """True when one rank's dump would not hold the whole state: several ranks, and a state each writes its
        part of (sharded layout) or one gathered by a collective. A dump this rank alone decides on (a precursor)
        is then made by every rank at the same step, through the step's all-reduce (capture/precursors/monitor.py)."""
        if not self.multi_rank:
            return False
        if self.dtensors:  # written sharded, or gathered whole by a collective: either way every rank takes part
            return True
        return self._choose_layout(self._state_references()) is StateLayout.SHARDED

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
        except Exception as exc:  # recorded, then re-raised unchanged
            self.record_exception(exc)
            raise

    def record_exception(self, exc: BaseException) -> Path | None:
        """Dumps the step in progress because it raised `exc` (`capture_errors()`, the excepthook and the
        Lightning callback call this). Never raises; returns the dump's path, or None.

        Raised after check(), the optimizer's step hooks tell where: inside the update (the manifest says
        `state_may_be_partial`) or after it, between steps (capture/raised/exceptions.py `dump_raised`).
        """
        try:
            return exceptions.dump_raised(self, exc, self._current)
        except Exception:  # the job is already failing: never add a second error
            log.exception("forensics: dumping the step that raised %s failed", type(exc).__name__)
            return None
        finally:
            self._current = None  # the step is over; a job that catches the error starts the next one afresh

    # -- what the checks and the dump path call back (capture/check/sync.py, sync_free.py, dump/dumper.py) -----
    @property
    def multi_rank(self) -> bool:
        """Several ranks under an initialised process group (each step then agrees across ranks)."""
        return self.world_size > 1 and distributed()

    def add_hook(self, handle: Any) -> None:
        """Keeps a removable hook handle; close() removes it."""
        self._hooks.append(handle)

    def device_lost(self) -> None:
        """The CUDA context is unusable: sync_free's buffers the device may still write into are never reused."""
        if self._sync_free is not None:
            self._sync_free.quarantine()

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
        if admission.why_not is None or policy is not Policy.CONTINUE:
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

    def not_dumped(self, trigger: Any, step: int, why: str, reason: str) -> None:
        """Counts a trigger that is not dumped (`why`; `reason` its key in the manifest's `dump_budget`), logged once
        per window (capture/dump/budget.py)."""
        self.dumper.not_dumped(trigger, step, why, reason)

    # -- lifecycle -------------------------------------------------------------------------------
    def flush(self) -> None:
        """GuardConfig.sync_free: judges the last checked step now (dump, policy); a no-op otherwise.

        Raises:
            TrainingFaultError: under the 'raise' policy, when that step was non-finite.
        """
        if self._sync_free is not None:
            self._sync_free.flush()

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
