"""The in-job Guard: records each step's micro-batches and RNG, detects faults, writes the dump, applies policy.

Costs on a healthy step: an RNG snapshot per micro-batch (host only), one fused grad-norm reduction
when the loop does not pass its own, and exactly one device->host transfer (inside `check`). Under
torchrun (world size > 1, torch.distributed initialised) add one all-reduce, so that every rank
triggers on the same step (capture/agreement.py); framework adapters live in capture.integrations.
GuardConfig(sync_free=True) removes the transfer for fused optimizers (capture/deferred.py).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from capture import deferred, environment, snapshot
from capture.agreement import Agreement, agree, deferred_termination, default_run_id, dist_info, distributed, \
    unwrap_model
from capture.config import GuardConfig
from capture.detectors import SpikeDetector
from capture.history import History
from capture.recipe import build_recipe
from capture.writer_thread import BackgroundWriter
from forensics.errors import CaptureError, TrainingFaultError
from forensics.format.writer import DumpContent, write_dump
from forensics.rng import RngState, capture_rng, restore_rng

log = logging.getLogger(__name__)

MAX_MICRO_BATCHES = 4096  # a step with more micro-batches means check() is never called


@dataclass
class StepRecord:
    """What the Guard keeps of the step in progress: references only, nothing copied."""

    batches: list[Any] = field(default_factory=list)
    sample_ids: list[Any] = field(default_factory=list)
    rng: list[RngState] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    autocast: dict | None = None


@dataclass
class Trigger:
    kind: str
    value: float
    threshold: float | None
    micro_batch: int | None
    detail: str
    local: bool = True

    def as_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "threshold": self.threshold,
                "micro_batch": self.micro_batch, "detail": self.detail, "local": self.local}


def _json_ids(ids: Any) -> list | None:
    if ids is None:
        return None
    if isinstance(ids, torch.Tensor):
        return ids.detach().cpu().reshape(-1).tolist()
    return [i.item() if isinstance(i, torch.Tensor) else i for i in ids]


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        size = _batch_size(value)
        if size is not None:
            return size
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
    """

    sharded_grad_norm = False
    """True when the grad norm passed to check() is the norm of this rank's shard only (ZeRO)."""

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
        self.loss_detector = SpikeDetector(self.config.loss_spike)
        self.grad_detector = SpikeDetector(self.config.grad_norm_spike)
        self.dumps: list[Path] = []
        self.dump_errors: list[str] = []
        # max_dumps slots: taken when a dump starts (background writes land later). One process gives a slot
        # back when its write fails; several ranks do not (attempts are identical on every rank, failures
        # are not, and a collective state gather must be entered by every rank or by none).
        self._dump_slots = threading.Semaphore(self.config.max_dumps)
        self._current: StepRecord | None = None
        self._last_spike_dump: int | None = None
        self._writer = BackgroundWriter()
        self._hooks: list[Any] = [model.register_forward_pre_hook(self._note_autocast)]
        self._pre_step_copy: dict | None = None
        self._last_step: StepRecord | None = None
        self._scheduler_snapshot: dict | None = None  # sync_free: the scheduler state saved at the dumped step
        self._sync_free = deferred.SyncFree(self) if self.config.sync_free else None
        environment.environment()  # versions, git commit: read now, not while a fault is being dumped
        if self.config.verify_update:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
            self._hooks.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    # -- recording (hot path: references and host-side RNG only) ---------------------------------
    def record_batch(self, batch: Any, sample_ids: Any = None) -> None:
        """Call once per micro-batch, after it is loaded and before its forward."""
        try:
            if self._current is None:
                self._current = StepRecord()
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
        """Call once per micro-batch with its loss BEFORE any division by the accumulation count."""
        if self._current is None:
            return
        try:
            value = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        except (TypeError, ValueError):  # capture must never break the job
            log.warning("forensics: record_loss got %s, not a number or tensor; ignored", type(loss).__name__)
            return
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
            step: the global step number; default: an internal counter.
        Returns:
            True to go on with optimizer.step(); False when the step must be skipped (skip policy).
        Raises:
            TrainingFaultError: under the 'raise' policy, after the dump is written (or failed to be).
        """
        if step is not None:
            self.step = step
        record, self._current = self._current or StepRecord(), None
        try:
            decision = self._sync_free.check(record, grad_norm) if self._sync_free else self._check(record, grad_norm)
        except TrainingFaultError:
            self._last_step = record
            self.step += 1  # a job that catches the error and goes on must not reuse this step's number
            raise
        except Exception:  # noqa: BLE001
            log.exception("forensics: the check of step %d failed inside forensics; training continues", self.step)
            decision = True
        self._last_step = record
        self.step += 1
        return decision

    def _gather(self, record: StepRecord, grad_norm: Any
                ) -> tuple[list[float], float | None, float | None, Agreement | None]:
        """One device->host transfer of per-micro-batch losses, grad norm and loss scale (and, with several
        ranks, the step's one all-reduce: capture/agreement.py).

        Python numbers stay on the host: building a device tensor from one would be a pageable
        host->device copy, which waits for the stream just like a sync.
        """
        if grad_norm is None:
            grad_norm = self._grad_norm()
        scale = getattr(self.scaler, "_scale", None) if self.scaler is not None and self.scaler.is_enabled() else None
        values: list[Any] = [*record.losses, grad_norm, scale]
        n = len(record.losses)
        agreed = None
        if self._multi_rank():
            host, agreed = agree(values, n, divisor=self._divisor(record), min_loss_scale=self.config.min_loss_scale,
                                 sharded_grad_norm=self.sharded_grad_norm)
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

    def _multi_rank(self) -> bool:
        return self.world_size > 1 and distributed()

    def _grad_norm(self) -> torch.Tensor | None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return None
        norms = torch._foreach_norm(grads)
        device = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in norms]))

    def _check(self, record: StepRecord, grad_norm: Any) -> bool:
        losses, norm, loss_scale, agreed = self._gather(record, grad_norm)
        divisor = self._divisor(record)
        step_loss = sum(losses) / divisor if losses else None
        scaler_overflow = loss_scale is not None and norm is not None and not math.isfinite(norm)
        trigger = self._detect(losses, norm, step_loss, loss_scale, agreed)
        if trigger is None and agreed is not None and agreed.fault:
            trigger = Trigger("nonfinite_grad", norm, None, None,
                              "another rank saw a non-finite loss or gradient at this step", local=False)
        clipped = (None if self.config.max_grad_norm is None or norm is None or not math.isfinite(norm)
                   else norm > self.config.max_grad_norm)
        skip = trigger is not None and self._policy(trigger) == "skip"
        self.history.append(self.step, step_loss, norm, snapshot.current_lr(self.optimizer), loss_scale, clipped,
                            skip or scaler_overflow)
        if trigger is None:
            return True
        return self._on_trigger(trigger, record, losses, norm, divisor)

    def _divisor(self, record: StepRecord) -> float:
        return float(self.config.loss_divisor or max(len(record.losses), 1))

    def _detect(self, losses: list[float], norm: float | None, step_loss: float | None,
                loss_scale: float | None, agreed: Agreement | None = None) -> Trigger | None:
        """This rank's trigger, if any. With several ranks (`agreed`), the spike detectors see the values
        agreed across ranks, so their windows, and so their verdicts, are identical on every rank."""
        for index, value in enumerate(losses):
            if not math.isfinite(value):
                return Trigger("nonfinite_loss", value, None, index, f"loss of micro-batch {index} is {value}")
        if norm is not None and not math.isfinite(norm):  # None: no gradients to measure, not a fault
            if agreed is not None and agreed.loss_fault:
                return None  # another rank's non-finite loss reached these gradients through their all-reduce
            if loss_scale is None:
                return Trigger("nonfinite_grad", norm, None, None, f"gradient norm is {norm} with a finite loss")
            if loss_scale <= self.config.min_loss_scale:
                return Trigger("nonfinite_grad", norm, self.config.min_loss_scale, None,
                               f"gradients overflow and the loss scale has collapsed to {loss_scale}")
            return None  # a normal GradScaler overflow: it skips the step and lowers the scale
        own_loss, own_norm, where = step_loss, norm, ""
        if agreed is not None:
            if agreed.fault:
                return None  # another rank's fault (the caller adds that trigger); the spike windows stay as they are
            step_loss, norm, where = agreed.step_loss, agreed.grad_norm, " (agreed across ranks)"
        worst = max(range(len(losses)), key=lambda i: losses[i]) if losses else None
        limit = self.loss_detector.observe(step_loss)
        if limit is not None:
            return Trigger("loss_spike", step_loss, limit, worst,
                           f"loss {step_loss:.4g}{where} is above the spike threshold {limit:.4g}",
                           local=own_loss is not None and own_loss > limit)
        limit = self.grad_detector.observe(norm)
        if limit is not None:
            return Trigger("grad_norm_spike", norm, limit, worst,
                           f"grad norm {norm:.4g}{where} is above the spike threshold {limit:.4g}",
                           local=own_norm is not None and own_norm > limit)
        return None

    def _policy(self, trigger: Trigger) -> str:
        return self.config.on_spike if trigger.kind.endswith("_spike") else self.config.on_nonfinite

    # -- on trigger ------------------------------------------------------------------------------
    def _on_trigger(self, trigger: Trigger, record: StepRecord, losses: list[float], norm: float,
                    divisor: float, state: dict | None = None) -> bool:
        policy = self._policy(trigger)
        log.warning("forensics: step %d rank %d: %s (policy: %s)", self.step, self.rank, trigger.detail, policy)
        dump_path, dump_error = self._maybe_dump(trigger, record, losses, norm, divisor, policy, state)
        if policy == "raise":
            where = f"dump written to {dump_path}" if dump_path else f"NO dump was written: {dump_error}"
            raise TrainingFaultError(
                f"step {self.step}: {trigger.detail}; {where}. "
                + (f"Replay it with: forensics replay {dump_path}" if dump_path else ""),
                trigger.as_dict(), dump_path, dump_error)
        return policy != "skip"

    def _maybe_dump(self, trigger: Trigger, record: StepRecord, losses: list[float], norm: float,
                    divisor: float, policy: str, state: dict | None = None) -> tuple[Path | None, str | None]:
        spike = trigger.kind.endswith("_spike")
        if spike and self._last_spike_dump is not None and self.step - self._last_spike_dump < self.config.min_spike_gap:
            return None, f"a spike was dumped {self.step - self._last_spike_dump} steps ago (GuardConfig.min_spike_gap)"
        if not self._dump_slots.acquire(blocking=False):
            return None, f"the cap of {self.config.max_dumps} dumps per run is reached (GuardConfig.max_dumps)"
        if spike:
            self._last_spike_dump = self.step  # at the attempt, as the slot: the same on every rank
        with deferred_termination():
            return self._dump(trigger, record, losses, norm, divisor, spike and policy == "continue", state)

    def _dump(self, trigger: Trigger, record: StepRecord, losses: list[float], norm: float, divisor: float,
              may_background: bool, state: dict | None) -> tuple[Path | None, str | None]:
        background = may_background and self.config.background_write
        try:
            content = self._content(trigger, record, losses, norm, divisor, background, state)
        except Exception as exc:  # noqa: BLE001
            message = f"no dump written: collecting the state failed ({type(exc).__name__}: {exc})"
            self._failed(message)
            return None, message
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

    def _failed(self, message: str) -> None:
        if not self._multi_rank():  # several ranks: the attempt counts (see __init__)
            self._dump_slots.release()
        self.dump_errors.append(message)
        log.error("forensics: %s", message)

    def _content(self, trigger: Trigger, record: StepRecord, losses: list[float], norm: float,
                 divisor: float, background: bool, state: dict | None) -> DumpContent:
        copy = snapshot.HostCopy(enabled=background)
        if state is None:
            state = self.collect_state(copy)
        batches = [self._copy_tree(b, copy) for b in record.batches]
        copy.finish()
        content = DumpContent(
            manifest=self._manifest(trigger, record, losses, norm, divisor),
            model=state["model"], optimizer=state["optimizer"], rng=list(record.rng), micro_batches=batches,
            history=self.history.to_dict(),
            scheduler=self._scheduler_snapshot or snapshot.scheduler_state(self.scheduler),
            scaler=snapshot.scaler_state(self.scaler))
        content.ready = copy.wait  # the writer waits for the device copies before touching them
        return content

    def collect_state(self, copy: snapshot.HostCopy) -> dict:
        """Full, name-keyed model and optimizer state. Framework adapters (ZeRO) override this."""
        return {"model": snapshot.model_state(self.model, copy),
                "optimizer": snapshot.optimizer_state(self.optimizer, self.model, copy)}

    def _copy_tree(self, node: Any, copy: snapshot.HostCopy) -> Any:
        if isinstance(node, torch.Tensor):
            return copy(node)
        if isinstance(node, dict):
            return {k: self._copy_tree(v, copy) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(self._copy_tree(v, copy) for v in node) if not hasattr(node, "_fields") else node
        return node

    def _manifest(self, trigger: Trigger, record: StepRecord, losses: list[float], norm: float,
                  divisor: float) -> dict:
        recheck = self._recheck(trigger, record, losses)
        micro_batches = []
        for index, batch in enumerate(record.batches):
            ids = _json_ids(record.sample_ids[index])
            size = _batch_size(batch) or (len(ids) if ids else None)
            if ids is None and size is not None:
                ids = [f"step{self.step}/rank{self.rank}/mb{index}/{j}" for j in range(size)]
            micro_batches.append({"index": index, "sample_ids": ids, "batch_size": size,
                                  "loss": losses[index] if index < len(losses) else None,
                                  "ids_are_positional": record.sample_ids[index] is None})
        param = next(iter(self.model.parameters()), None)
        return {
            "run_id": self.run_id, "trigger": trigger.as_dict(), "step": self.step, "rank": self.rank,
            "world_size": self.world_size, "local_rank": self.local_rank, "grad_accum": len(record.batches),
            "micro_batches": micro_batches,
            "loss": {"per_micro_batch": losses, "divisor": divisor, "grad_norm": norm,
                     "step_loss": sum(losses) / divisor if losses else None},
            "precision": {"param_dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
                          "autocast": record.autocast or {"enabled": False, "device_type": None, "dtype": None},
                          "grad_scaler": snapshot.scaler_state(self.scaler)},
            "determinism": environment.determinism_flags(),
            "environment": environment.environment(),
            "recipe": build_recipe(self.model, self.loss_fn, self.config.sample_id_key, self.config.recipe),
            "recheck": recheck,
            "missing_ranks": [],
        }

    def _recheck(self, trigger: Trigger, record: StepRecord, losses: list[float]) -> dict:
        """Megatron-style in-job re-check: recompute the failing micro-batch's loss with its RNG."""
        index = trigger.micro_batch
        if not self.config.recheck or index is None or index >= len(record.batches):
            return {"performed": False}
        from forensics.recipes import default_loss

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
        original = losses[index]
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
        bad = next(name for name, p in self.model.named_parameters() if not bool(torch.isfinite(p).all()))
        step = self.step - 1  # check() already advanced the counter
        record = self._last_step or StepRecord()
        trigger = Trigger("nonfinite_param", float("nan"), None, None,
                          f"the optimizer update of step {step} made parameter {bad} non-finite")
        saved_step, self.step = self.step, step
        try:
            norm = self.history.to_dict()["grad_norm"][-1] if len(self.history) else float("nan")
            self._on_trigger(trigger, record, [float(v) for v in record.losses], norm, self._divisor(record), state)
        finally:
            self.step = saved_step

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
            self._writer.join(timeout)
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
