"""The in-job Guard: records each step's micro-batches and RNG, detects faults, writes the dump, applies policy.

Costs on a healthy step: an RNG snapshot per micro-batch (host only), one fused grad-norm reduction
when the loop does not pass its own, and exactly one device->host transfer (inside `check`). Under
torchrun (world size > 1, torch.distributed initialised) add one all-reduce, so that every rank
triggers on the same step (capture/agreement.py); framework adapters live in capture.integrations.
GuardConfig(sync_free=True) removes the transfer for fused optimizers (capture/deferred.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from capture import buddy, deferred, environment, exceptions, sharding, snapshot
from capture.buffers import PreForwardBuffers
from capture.host_snapshots import HostSnapshots
from capture.agreement import Agreement, agree, deferred_termination, default_run_id, dist_info, distributed, \
    unwrap_model
from capture.config import GuardConfig
from capture.detectors import StepDetectors
from capture.history import History
from capture.incident import Incident, StepRecord, Trigger, batch_size, json_ids
from capture.recipe import build_recipe, default_loss_fits
from capture.uploads import send_dump
from capture.window import FlightRecorder, WindowStep
from capture.writer_thread import BackgroundWriter
from forensics.errors import CaptureError, TrainingFaultError
from forensics.format.writer import DumpContent, write_dump
from forensics.grad_norm import total_grad_norm
from forensics.kinds import Policy, StateLayout, TriggerKind
from forensics.recipes import default_loss
from forensics.rng import capture_rng, restore_rng

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

    Framework adapters (capture/integrations/) subclass the Guard and override only these hooks:
        at_step_boundary()       -- is this check() an optimizer-step boundary (gradient accumulation)?
        step_number()            -- the framework's global step, or None for the Guard's own counter
        compute_grad_norm()      -- the grad norm when the loop passes none (ZeRO: this rank's shard)
        collect_state(copy)      -- the name-keyed model and optimizer state to dump (ZeRO: gathered)
        replay_recipe()          -- the manifest's `recipe` (how replay rebuilds the model)
        describe_distribution()  -- the manifest's `distributed` section (framework, ZeRO stage ...)
        state_is_collective      -- collect_state() is a collective (then a step that raises on one rank is not dumped)
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
        """The flight recorder: sample IDs, RNG and scalars of the last window_steps steps (capture/window.py)."""
        self.snapshots = HostSnapshots(self.config.snapshot_every, self.config.snapshot_count)
        """Host copies of the state every snapshot_every steps (capture/host_snapshots.py)."""
        self.buffers = PreForwardBuffers(model)
        """The model's buffers before the step's first forward (capture/buffers.py): dumped, restored on skip."""
        self.dtensors = sharding.has_dtensors(model)
        """The model holds DTensors (FSDP2, tensor parallel): state is written from local shards."""
        self.fsdp_units = self._fsdp_units() if self.dtensors else []
        """FSDP2 units and their mixed-precision policies (the manifest's precision.fsdp)."""
        if self.dtensors and self.config.recheck:
            log.warning("forensics: recheck is off for a DTensor (FSDP2 / tensor-parallel) model: a forward on the "
                        "ranks that saw the fault alone would wait forever for the others")
            self.config = dataclasses.replace(self.config, recheck=False)
        self.sharded_grad_norm = type(self).sharded_grad_norm or self.dtensors
        self.layout_used: StateLayout | None = None
        """The state layout of the last dump (GuardConfig.state_layout resolved)."""
        self.detectors = StepDetectors(self.config)
        self.dumps: list[Path] = []
        self.dump_errors: list[str] = []
        # max_dumps slots: taken when a dump starts (background writes land later). One process gives a slot
        # back when its write fails; several ranks do not (attempts are identical on every rank, failures
        # are not, and a collective state gather must be entered by every rank or by none).
        self._dump_slots = threading.Semaphore(self.config.max_dumps)
        self._current: StepRecord | None = None
        self._last_spike_dump: int | None = None
        self._suppressed_logged: set[TriggerKind] = set()
        self._warned_already_bad = False
        self._writer = BackgroundWriter()
        self._hooks: list[Any] = []
        self.add_hook(model.register_forward_pre_hook(self._note_autocast))
        self._pre_step_copy: dict | None = None
        self._last_step: StepRecord | None = None
        self._sync_free = deferred.SyncFree(self) if self.config.sync_free else None
        environment.environment()  # versions, git commit: read now, not while a fault is being dumped
        self._closed = False
        if self.config.capture_exceptions:
            exceptions.watch(self)
            if exceptions.nccl_watchdog_aborts_on_cuda_errors():
                log.warning("forensics: NCCL's watchdog aborts this process on a CUDA error (a device-side assert), "
                            "which can end the rank before its dump is written; to let the dump finish and the job "
                            "fail with its own exception, set TORCH_NCCL_RETHROW_CUDA_ERRORS=0 before "
                            "init_process_group (docs/INTEGRATIONS.md)")
        unfit = default_loss_fits(model, build_recipe(model, loss_fn, self.config.sample_id_key, self.config.recipe))
        if unfit:
            log.warning("forensics: %s", unfit)
        if self.config.verify_update:
            self.add_hook(optimizer.register_step_pre_hook(self._before_optimizer_step))
            self.add_hook(optimizer.register_step_post_hook(self._after_optimizer_step))

    # -- recording (hot path: references and host-side RNG only) ---------------------------------
    def record_batch(self, batch: Any, sample_ids: Any = None) -> None:
        """Call once per micro-batch, after it is loaded and before its forward."""
        try:
            if self._current is None:
                self._current = StepRecord()
                self._take_buffers()
            record = self._current
            if len(record.batches) >= MAX_MICRO_BATCHES:
                return
            if sample_ids is None and isinstance(batch, Mapping):
                sample_ids = batch.get(self.config.sample_id_key)
            record.batches.append(batch)
            record.sample_ids.append(sample_ids)
            record.rng.append(capture_rng())
        except Exception:  # noqa: BLE001 - capture must never break the job
            log.exception("forensics: record_batch failed; this step will not be capturable")

    def record_loss(self, loss: Any) -> None:
        """Call once per micro-batch with its loss BEFORE any division by the accumulation count.

        Never raises: a tensor is kept by reference (its mean is read at check()); an empty tensor, or a
        value that does not convert to a float (an object whose __float__ raises, a Python int beyond the
        float range such as 10**400), is ignored with a warning."""
        if self._current is None:
            return
        value = loss_value(loss)
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
        if step is None:
            step = self.step_number()
        if step is not None:
            self.step = step
        record, self._current = self._current or StepRecord(), None
        try:
            sync_free = self._sync_free is not None and self._sync_free.active()
            decision = self._sync_free.check(record, grad_norm) if sync_free else self._check(record, grad_norm)
        except TrainingFaultError:
            self._last_step = record
            self.step += 1  # a job that catches the error and goes on must not reuse this step's number
            raise
        except Exception as exc:  # noqa: BLE001
            if exceptions.is_cuda_error(exc):  # the job's own device fault, surfacing at the step's one sync
                self._current = record  # dumped as the step that raised; the job fails with its own error
                self.record_exception(exc)
                self._current = None
                raise
            log.exception("forensics: the check of step %d failed inside forensics; training continues", self.step)
            decision = True
        if not decision and not sync_free:
            self._restore_buffers()
        self._last_step = record
        self.step += 1
        return decision

    def _fsdp_units(self) -> list[dict]:
        try:
            return sharding.fsdp_units(self.model)
        except Exception:  # noqa: BLE001 - a torch whose FSDP2 internals differ: replay then computes in fp32
            log.warning("forensics: could not read FSDP2's mixed-precision policies; replay will compute in the "
                        "parameters' dtype", exc_info=True)
            return []

    def _take_buffers(self) -> None:
        try:
            self.buffers.take()
        except Exception:  # noqa: BLE001 - a convenience: the dump then holds the buffers as check() sees them
            self.buffers.off = True
            log.exception("forensics: copying the model's buffers before the forward failed; not tried again")

    def _restore_buffers(self) -> None:
        """A skipped step: its forward's updates to the buffers (BatchNorm running statistics) are undone too."""
        try:
            restored = self.buffers.restore()
            if restored:
                log.warning("forensics: step %d skipped; %d buffer(s) its forward had updated (e.g. BatchNorm running "
                            "statistics) are back to their values before the step", self.step, restored)
        except Exception:  # noqa: BLE001
            log.exception("forensics: restoring the model's buffers after a skipped step failed")

    # -- adapter hooks (see the class docstring) -------------------------------------------------
    def at_step_boundary(self) -> bool:
        """True when this check() precedes an optimizer step (adapters: the gradient-accumulation boundary)."""
        return True

    def step_number(self) -> int | None:
        """The framework's global step for this check(), or None to use the Guard's own counter."""
        return None

    def compute_grad_norm(self) -> torch.Tensor | float | None:
        """The gradient norm of this step when the loop passed none (None: no gradients); for a DTensor model,
        the norm of this rank's shards (sharded_grad_norm)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.dtensors:
            return sharding.shard_grad_norm(grads)
        return total_grad_norm(grads)

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

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.detach()

        model = snapshot.model_state(self.model, keep)
        model.update({name: value for name, value in self.buffers.before().items() if name in model})
        return {"model": model, "optimizer": snapshot.optimizer_state(self.optimizer, self.model, keep)}

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

    def _take_snapshot(self) -> None:
        try:
            state = self.snapshot_state()
            if state is not None:
                self.snapshots.take(self.step, state)
        except Exception as exc:  # noqa: BLE001 - a snapshot is a convenience; the job goes on without it
            self.snapshots.turn_off(f"copying the state failed ({type(exc).__name__}: {exc})")

    def _choose_layout(self, full_form: dict) -> StateLayout:
        return sharding.choose_layout(self.config.state_layout, self.world_size if self.multi_rank else 1,
                                      self.dtensors, sharding.state_bytes(full_form), self.config.full_state_max_bytes)

    def replay_recipe(self) -> dict:
        """The manifest's `recipe`: import paths of the model factory and loss, never executed here."""
        return build_recipe(self.model, self.loss_fn, self.config.sample_id_key, self.config.recipe)

    def describe_distribution(self) -> dict | None:
        """The manifest's optional `distributed` section (None: omitted; several ranks: world size and layout)."""
        if not self.multi_rank:
            return None
        return {"framework": "torch", "world_size": self.world_size, "dtensor": self.dtensors,
                "state": self.state_words()}

    def state_words(self) -> str:
        """How the last dump's state was written, in words (the `distributed.state` field)."""
        if self.layout_used is StateLayout.SHARDED:
            return "sharded: each rank wrote its part (replay reads the step's rank dumps together)"
        return "full on every rank (replayable alone)"

    @property
    def state_is_collective(self) -> bool:
        """True when collect_state() is a collective (ZeRO gathers, DTensors written whole): then a step that
        raised on one rank is not dumped (the other ranks would never join the gather)."""
        if not (self.dtensors and self.multi_rank):
            return False
        full_form = self._state_references()
        return self._choose_layout(full_form) is StateLayout.FULL or sharding.needs_collective(full_form)

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

        A step whose optimizer update had already started is marked `state_may_be_partial` in the manifest.
        """
        try:
            return self._record_exception(exc)
        except Exception:  # noqa: BLE001 - the job is already failing: never add a second error
            log.exception("forensics: dumping the step that raised %s failed", type(exc).__name__)
            return None

    def _record_exception(self, exc: BaseException) -> Path | None:
        if isinstance(exc, TrainingFaultError) or getattr(exc, "_forensics_recorded", False):
            return None  # already dumped by check(), or by an outer capture_errors() / the excepthook
        try:
            exc._forensics_recorded = True
        except AttributeError:
            pass
        after_check = self._current is None
        record = self._current if not after_check else self._last_step
        if record is None or not record.batches:
            log.warning("forensics: %s raised outside a recorded step; nothing to dump", type(exc).__name__)
            return None
        if self.state_is_collective and self.multi_rank:
            log.error("forensics: step %d raised %s on rank %d; its ZeRO-sharded state cannot be gathered by one "
                      "rank alone, so it is not dumped (the micro-batches are in the traceback's frames)",
                      self.step, type(exc).__name__, self.rank)
            return None
        during = "optimizer" if after_check else "backward" if len(record.losses) >= len(record.batches) \
            else "forward"
        step = self.step - 1 if after_check else self.step
        section = exceptions.describe(exc, during, record.batches)
        section["state_may_be_partial"] = after_check
        index = len(record.batches) - 1 if during == "forward" else None
        trigger = Trigger(TriggerKind.EXCEPTION, math.nan, None, index,
                          f"{section['type']} during the {during}: {section['message'][:300]}")
        if self.multi_rank and section["peer_failure"]:  # this rank only saw another rank stop
            trigger.local = False
            trigger.detail = f"another rank stopped: a collective failed during the {during} ({section['type']})"
        losses = [v if isinstance(v, float) else math.nan for v in self._host_losses(record)]
        incident = Incident(trigger, step, record, losses, None, record.divisor(self.config.loss_divisor),
                            Policy.RAISE, exception=section)
        log.error("forensics: step %d rank %d raised %s; dumping the step", step, self.rank, trigger.message)
        path, error = self._maybe_dump(incident)
        if error:
            log.error("forensics: no dump of the step that raised: %s", error)
        if self._current is record:
            self._current = None  # the step is over; a job that catches the error starts the next one afresh
        return path

    def _host_losses(self, record: StepRecord) -> list[float | None]:
        try:
            return self._fetch(list(record.losses))
        except Exception:  # noqa: BLE001 - a broken device: the losses are a bonus
            return [v if isinstance(v, float) else None for v in record.losses]


    # -- helpers the Guard's modes share (capture/deferred.py) -----------------------------------
    @property
    def multi_rank(self) -> bool:
        """Several ranks under an initialised process group (each step then agrees across ranks)."""
        return self.world_size > 1 and distributed()

    def add_hook(self, handle: Any) -> None:
        """Keeps a removable hook handle; close() removes it."""
        self._hooks.append(handle)

    def _gather(self, record: StepRecord, grad_norm: Any
                ) -> tuple[list[float], float | None, float | None, Agreement | None]:
        """One device->host transfer of per-micro-batch losses, grad norm and loss scale (and, with several
        ranks, the step's one all-reduce: capture/agreement.py).

        Python numbers stay on the host: building a device tensor from one would be a pageable
        host->device copy, which waits for the stream just like a sync.
        """
        sharded = False
        if grad_norm is None:
            grad_norm, sharded = self.compute_grad_norm(), self.sharded_grad_norm
        grad_norm = sharding.host_norm(grad_norm)
        scale = getattr(self.scaler, "_scale", None) if self.scaler is not None and self.scaler.is_enabled() else None
        values: list[Any] = [*record.losses, grad_norm, scale]
        n = len(record.losses)
        agreed = None
        if self.multi_rank:
            host, agreed = agree(values, n, divisor=record.divisor(self.config.loss_divisor),
                                 min_loss_scale=self.config.min_loss_scale, sharded_grad_norm=sharded)
        else:
            host = self._fetch(values)
        return host[:n], host[n], host[n + 1], agreed

    @staticmethod
    def _fetch(values: list[Any]) -> list[float | None]:
        """Host numbers for `values` (None: unknown), stacked on their device and read in one transfer.
        A CPU tensor beside device tensors is read on the host (moving it to the device would wait)."""
        device = next((v.device for v in values if isinstance(v, torch.Tensor) and v.device.type != "cpu"),
                      torch.device("cpu"))
        on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.device == device]
        host = [None if v is None or i in on_device else
                float(v.detach().float().mean()) if isinstance(v, torch.Tensor) else float(v)
                for i, v in enumerate(values)]
        if on_device:
            fetched = torch.stack([values[i].detach().float().mean() for i in on_device]).tolist()  # the one sync
            for slot, i in enumerate(on_device):
                host[i] = fetched[slot]
        return host

    def _check(self, record: StepRecord, grad_norm: Any) -> bool:
        losses, norm, loss_scale, agreed = self._gather(record, grad_norm)
        divisor = record.divisor(self.config.loss_divisor)
        step_loss = sum(losses) / divisor if losses else None
        scaler_overflow = loss_scale is not None and norm is not None and not math.isfinite(norm)
        trigger = self.detectors.detect(losses, norm, step_loss, loss_scale, agreed)
        if trigger is None and agreed is not None and agreed.fault:
            trigger = Trigger(TriggerKind.NONFINITE_GRAD, norm, None, None,
                              "another rank saw a non-finite loss or gradient at this step", local=False)
        policy = self.config.policy_for(trigger.kind) if trigger is not None else None
        lr, clipped = snapshot.current_lr(self.optimizer), self.clipped(norm)
        self.history.append(self.step, step_loss, norm, lr, loss_scale,
                            clipped, policy is Policy.SKIP or scaler_overflow, self.note_suppressed())
        self.window.append(WindowStep(self.step, list(record.sample_ids), list(record.rng), lr, loss_scale, divisor,
                                      step_loss, norm, clipped))
        if trigger is None:
            self.snapshots.settle()
            if self.snapshots.due(self.step):
                self._take_snapshot()
            return True
        return self.handle_incident(Incident(trigger, self.step, record, losses, norm, divisor, policy,
                                             agreed=self.multi_rank))

    def note_suppressed(self) -> str | None:
        """Logs (once per kind and run) a spike that warm-up kept from firing at this step; returns its kind
        for the history, or None."""
        if not self.detectors.suppressed:
            return None
        first = self.detectors.suppressed[0]
        if first.kind not in self._suppressed_logged:
            self._suppressed_logged.add(first.kind)
            log.warning("forensics: step %d: %s. Early spikes are not dumped; to catch them, lower the warm-up, "
                        "e.g. GuardConfig(%s=SpikeConfig(warmup=8)). Logged once; every such step is marked in the "
                        "history (column 'suppressed').", self.step, first.detail,
                        "loss_spike" if first.kind is TriggerKind.LOSS_SPIKE else "grad_norm_spike")
        return first.kind.value

    def clipped(self, norm: float | None) -> bool | None:
        """Whether the loop's clipping (GuardConfig.max_grad_norm) fired at this norm (None: unknown)."""
        if self.config.max_grad_norm is None or norm is None or not math.isfinite(norm):
            return None
        return norm > self.config.max_grad_norm

    # -- on trigger ------------------------------------------------------------------------------
    def handle_incident(self, incident: Incident) -> bool:
        """Dumps the incident (within the caps) and applies its policy.

        Returns:
            False when the step must be skipped ('skip'), else True.
        Raises:
            TrainingFaultError: under 'raise', after the dump was written (or failed to be).
        """
        trigger, policy = incident.trigger, incident.policy
        log.warning("forensics: step %d rank %d: %s (policy: %s)", incident.step, self.rank, trigger.message, policy)
        dump_path, dump_error = self._maybe_dump(incident)
        if policy is Policy.RAISE:
            where = f"dump written to {dump_path}" if dump_path else f"NO dump was written: {dump_error}"
            raise TrainingFaultError(
                f"step {incident.step}: {trigger.message}; {where}. "
                + (f"Replay it with: forensics replay {dump_path}" if dump_path else ""),
                trigger.as_dict(), dump_path, dump_error)
        return policy is not Policy.SKIP

    def _maybe_dump(self, incident: Incident) -> tuple[Path | None, str | None]:
        spike, step = incident.trigger.kind.spike, incident.step
        if spike and self._last_spike_dump is not None and step - self._last_spike_dump < self.config.min_spike_gap:
            return None, f"a spike was dumped {step - self._last_spike_dump} steps ago (GuardConfig.min_spike_gap)"
        if not self._dump_slots.acquire(blocking=False):
            return None, f"the cap of {self.config.max_dumps} dumps per run is reached (GuardConfig.max_dumps)"
        if spike:
            self._last_spike_dump = step  # at the attempt, as the slot: the same on every rank
        with deferred_termination():
            return self._dump(incident, background=spike and incident.policy is Policy.CONTINUE
                              and self.config.background_write)

    def _dump(self, incident: Incident, background: bool) -> tuple[Path | None, str | None]:
        unusable = "the CUDA context is unusable after a CUDA error" if (incident.exception or {}).get("cuda_error") \
            else None
        try:
            content = self._host_content(incident, unusable, device_usable=False) if unusable \
                else self._content(incident, background)
        except Exception as exc:  # noqa: BLE001
            unusable = f"collecting the state failed ({type(exc).__name__}: {str(exc)[:300]})"
            content = self._host_content(incident, unusable) if incident.exception is not None else None
        if content is None:
            self._failed(f"no dump written: {unusable}")
            return None, f"no dump written: {unusable}"
        if background:
            path = self._writer.submit(content, self.config.dump_dir, self._written, self._failed)
            return path, None
        try:
            path = write_dump(content, self.config.dump_dir)
        except CaptureError as exc:
            self._failed(str(exc))
            return None, str(exc)
        self._written(path)
        return path, None

    def _written(self, path: Path) -> None:
        self.dumps.append(path)
        log.warning("forensics: dump written to %s — replay it with: forensics replay %s", path, path)
        if self.config.upload:
            send_dump(path, self.config.upload, self.config.tensorboard_dir)
        if self.config.on_dump is not None:
            try:
                self.config.on_dump(path)
            except Exception:  # noqa: BLE001 - the user's hook must not stop the job either
                log.exception("forensics: GuardConfig.on_dump raised for %s", path)

    def _failed(self, message: str) -> None:
        if not self.multi_rank:  # several ranks: the attempt counts (see __init__)
            self._dump_slots.release()
        self.dump_errors.append(message)
        log.error("forensics: %s", message)

    def _content(self, incident: Incident, background: bool) -> DumpContent:
        copy = snapshot.HostCopy(enabled=background)
        state = incident.state if incident.state is not None else self.collect_state(copy)
        batches = [self._copy_tree(b, copy) for b in incident.record.batches]
        if incident.state is not None:  # collected earlier, live tensors: fence their devices too
            copy.cover(state)
        copy.finish()
        manifest = self._manifest(incident)
        held, release = self._lend_snapshot(incident.step, manifest) if "layout" not in state else (None, None)
        content = DumpContent(
            manifest=manifest, snapshot=held, done=release,
            model=state["model"], optimizer=state["optimizer"], rng=list(incident.record.rng),
            micro_batches=batches, history=self.history.to_dict(),
            scheduler=incident.scheduler or snapshot.scheduler_state(self.scheduler),
            scaler=snapshot.scaler_state(self.scaler), layout=state.get("layout"),
            copies=self._buddy_copies(state, incident), extra_files=self.window.files(incident.step))
        content.ready = copy.wait  # the writer waits for the device copies before touching them
        return content

    def _buddy_copies(self, state: dict, incident: Incident) -> list:
        """Sharded layout with GuardConfig.shard_replicas >= 2: the shards only other ranks hold, received from
        them (capture/buddy.py) — only in a dump every rank makes, before any rank writes."""
        if "layout" not in state or self.config.shard_replicas < 2 or not incident.agreed:
            return []
        return buddy.exchange(buddy.sole_shards(state), self.rank, self.world_size, self.config.shard_replicas)

    def _lend_snapshot(self, step: int, manifest: dict, device_usable: bool = True) -> tuple[dict | None, Any]:
        """The oldest host snapshot the flight recorder covers for a dump of `step` (noted in its manifest), and
        the function that gives it back once the dump is written; (None, None) when there is none."""
        earlier = self.window.steps_before(step)
        held, release = self.snapshots.lend_oldest(earlier[0], device_usable) if earlier else (None, None)
        if held is not None:
            manifest["snapshot"] = {"step": held["step"]}
        return held, release

    def _host_content(self, incident: Incident, why: str, device_usable: bool = True) -> DumpContent | None:
        """A step that raised and left the state unreadable (a CUDA error kills the context): what the host still
        holds — sample IDs, host-side batch tensors, RNG, history, the flight recorder, the optimizer's class and
        hyper-parameters and the last host snapshot — with `state_missing` saying why the rest is absent. None
        when even that fails."""
        try:
            manifest = self._manifest(incident)
            manifest["state_missing"] = why
            held, release = self._lend_snapshot(incident.step, manifest, device_usable)
            if not device_usable and self._sync_free is not None:
                self._sync_free.quarantine()
            try:
                scheduler = incident.scheduler or snapshot.scheduler_state(self.scheduler)
            except Exception:  # noqa: BLE001 - a scheduler state on the device
                scheduler = None
            log.error("forensics: step %d: %s; writing what the host holds (no pre-step state%s)", incident.step, why,
                      f"; the host snapshot of step {held['step']}" if held else "")
            return DumpContent(
                manifest=manifest, model={}, optimizer=snapshot.optimizer_hyper(self.optimizer, self.model),
                rng=list(incident.record.rng), micro_batches=[snapshot.host_only(b) for b in incident.record.batches],
                history=self.history.to_dict(), scheduler=scheduler, snapshot=held, done=release,
                extra_files=self.window.files(incident.step))
        except Exception:  # noqa: BLE001 - the job is failing already
            log.exception("forensics: even the host-side dump of step %d failed", incident.step)
            return None

    def _copy_tree(self, node: Any, copy: snapshot.HostCopy) -> Any:
        if isinstance(node, torch.Tensor):
            return copy(node)
        if isinstance(node, dict):
            return {k: self._copy_tree(v, copy) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(self._copy_tree(v, copy) for v in node) if not hasattr(node, "_fields") else node
        return node

    def _manifest(self, incident: Incident) -> dict:
        record, losses, step = incident.record, incident.losses, incident.step
        micro_batches = []
        for index, batch in enumerate(record.batches):
            ids = json_ids(record.sample_ids[index])
            size = batch_size(batch) or (len(ids) if ids else None)
            if ids is None and size is not None:
                ids = [f"step{step}/rank{self.rank}/mb{index}/{j}" for j in range(size)]
            micro_batches.append({"index": index, "sample_ids": ids, "batch_size": size,
                                  "loss": losses[index] if index < len(losses) else None,
                                  "ids_are_positional": record.sample_ids[index] is None})
        param = next(iter(self.model.parameters()), None)
        manifest = {
            "run_id": self.run_id, "trigger": incident.trigger.as_dict(), "step": step, "rank": self.rank,
            "world_size": self.world_size, "local_rank": self.local_rank, "grad_accum": len(record.batches),
            "micro_batches": micro_batches,
            "loss": {"per_micro_batch": losses, "divisor": incident.divisor, "grad_norm": incident.grad_norm,
                     "step_loss": incident.step_loss},
            "precision": {"param_dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
                          "autocast": record.autocast or {"enabled": False, "device_type": None, "dtype": None},
                          "grad_scaler": self._scaler_state(),
                          **({"fsdp": self.fsdp_units} if self.fsdp_units else {})},
            "determinism": environment.determinism_flags(),
            "environment": environment.environment(),
            "recipe": self.replay_recipe(),
            "recheck": self._recheck(incident),
            "missing_ranks": [],
        }
        window = self.window.steps_before(step)
        if window:
            manifest["window"] = {"first_step": window[0], "last_step": window[-1], "steps": len(window),
                                  "max_grad_norm": self.config.max_grad_norm}
        if self.config.data_recipe:
            manifest["data_recipe"] = dict(self.config.data_recipe)
        distribution = self.describe_distribution()
        if distribution is not None:
            manifest["distributed"] = distribution
        if incident.exception is not None:
            manifest["exception"] = incident.exception
        return manifest

    def _scaler_state(self) -> dict | None:
        try:
            return snapshot.scaler_state(self.scaler)
        except Exception:  # noqa: BLE001 - its scale lives on a device that may be unusable (a CUDA error)
            return None

    def _recheck(self, incident: Incident) -> dict:
        """Megatron-style in-job re-check: recompute the failing micro-batch's loss with its RNG."""
        record, index = incident.record, incident.trigger.micro_batch
        if not self.config.recheck or index is None or index >= len(record.batches) or incident.exception:
            return {"performed": False}
        saved = capture_rng()
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]  # BatchNorm stats move in a forward
        try:
            restore_rng(record.rng[index])
            autocast = record.autocast or {}
            with torch.no_grad(), torch.autocast(autocast.get("device_type") or "cpu",
                                                 dtype=getattr(torch, autocast.get("dtype") or "bfloat16"),
                                                 enabled=bool(autocast.get("enabled"))):
                if self.loss_fn is not None:
                    value = float(self.loss_fn(self.model, record.batches[index]))
                else:
                    value = float(default_loss(self.model, record.batches[index], [self.config.sample_id_key]))
        except Exception as exc:  # noqa: BLE001
            return {"performed": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            restore_rng(saved)
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)
        original = incident.losses[index]
        same = (value == original) or (not math.isfinite(value) and not math.isfinite(original))
        return {"performed": True, "micro_batch": index, "original": original, "recomputed": value,
                "reproduced": bool(same or (math.isfinite(value) and math.isfinite(original)
                                            and abs(value - original) <= 1e-3 * max(1.0, abs(original))))}

    # -- optional update verification (GuardConfig.verify_update) --------------------------------
    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        try:
            copy = snapshot.HostCopy(enabled=True)
            self._pre_step_copy = self.collect_state(copy)
            copy.finish()
            copy.wait()
        except Exception:  # noqa: BLE001
            log.exception("forensics: verify_update could not copy the pre-step state")
            self._pre_step_copy = None

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        state, self._pre_step_copy = self._pre_step_copy, None
        if state is None:
            return
        params = [p for p in self.model.parameters()]
        if not params or bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
            return
        step = self.step - 1  # check() already advanced the counter
        before = state.get("model") or {}
        broken = [name for name, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())]
        newly = [name for name in broken
                 if name not in before or bool(torch.isfinite(before[name]).all())]  # finite before this update
        if not newly:
            if not self._warned_already_bad:
                self._warned_already_bad = True
                log.warning("forensics: verify_update: %s was already non-finite before the update of step %d, so that "
                            "update is not blamed (an earlier step, or the data loaded into the model, broke it)",
                            broken[0], step)
            return
        bad = newly[0]
        record = self._last_step or StepRecord()
        trigger = Trigger(TriggerKind.NONFINITE_PARAM, float("nan"), None, None,
                          f"the optimizer update of step {step} made parameter {bad} non-finite")
        norm = self.history.to_dict()["grad_norm"][-1] if len(self.history) else float("nan")
        self.handle_incident(Incident(trigger, step, record, [float(v) for v in record.losses], norm,
                                      record.divisor(self.config.loss_divisor),
                                      self.config.policy_for(trigger.kind), state=state))

    # -- lifecycle -------------------------------------------------------------------------------
    def flush(self) -> None:
        """GuardConfig.sync_free: judges the last checked step now (dump, policy); a no-op otherwise.

        Raises:
            TrainingFaultError: under the 'raise' policy, when that step was non-finite.
        """
        if self._sync_free is None:
            return
        try:
            self._sync_free.resolve()
        except TrainingFaultError:
            raise
        except Exception:  # noqa: BLE001
            log.exception("forensics: judging the last step failed inside forensics")

    def close(self, timeout: float | None = None) -> None:
        """Judges a step still pending (sync_free), waits for background dump writes, removes the hooks."""
        try:
            self.flush()
        finally:
            self._closed = True
            exceptions.unwatch(self)
            self._writer.join(timeout)
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
