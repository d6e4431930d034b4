"""The Guard's sync-free mode (GuardConfig.detection.sync_free): the step is skipped on the device, judged one step
later.

The default check reads the step's losses and grad norm on the host before optimizer.step(), which
stalls the host until the GPU has finished backward, so the optimizer's kernel launches are no longer
hidden behind GPU work. Here, for optimizers whose step() honours the `found_inf` / `grad_scale`
attributes GradScaler sets (`_step_supports_amp_scaling`: fused Adam / AdamW / SGD / Adagrad):

1. check() computes on the device a 0/1 `found_inf` = "some micro-batch loss or the grad norm is
   non-finite" and sets `optimizer.found_inf`, `optimizer.grad_scale = None`. The user's plain
   optimizer.step() then skips the update on the device when it is 1: the fused kernel returns early
   and undoes the step counter it had just incremented (torch/optim/adam.py `_fused_adam`). A step
   post-hook removes both attributes, as GradScaler.step does with `del`.
2. check() starts a non-blocking copy of the step's scalars into a (pinned) host buffer, records a
   CUDA event and returns True without waiting.
3. The next check() (or Guard.flush() / Guard.close()) reads those scalars (the event is long
   complete unless the host runs more than a step ahead), feeds the history and the detectors, and
   applies the policy to that step. A non-finite step was not applied, so the state at that moment
   IS its pre-step state: it is dumped with that step's micro-batches, RNG, losses, and the scheduler
   state and optimizer hyper-parameters saved at its check.

Limits: see the GuardConfig.detection.sync_free docstring (capture/config.py).
"""

from __future__ import annotations

import logging
import math
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch

from capture.check.detectors import StepDetectors, clipped
from capture.config import GuardConfig
from capture.record.history import History
from capture.record.incident import Incident, Undumpable, StepRecord
from capture.state import snapshot
from capture.state.source import StateSource
from forensics.device_sync import DeviceFence, quarantine
from forensics.thirdparty import optimizer_honours_found_inf

log = logging.getLogger(__name__)

LATE = " (sync_free: detected one step late, at the next step's check; this step's update was skipped on the device)"
SPIKE_LATE = " (detected one step late)"
SPIKE_NOT_DUMPED = Undumpable("sync_free: seen one step late, after its update", "sync_free",
                             "sync_free mode does not dump spikes (the spike step's update was already applied)")


@dataclass
class Pending:
    """A step whose scalars are on their way to the host."""

    step: int
    record: StepRecord
    n_losses: int
    host: dict[int, float | None]  # values already on the host (Python numbers, tensors off the device)
    device_index: list[int]  # positions of the values in `buffer`
    buffer: torch.Tensor
    landed: DeviceFence  # passed once `buffer` holds the values (CPU: at once, the copy was synchronous)
    lr: float | None
    scheduler: dict | None
    hyper: list[dict]
    divisor: float


def unsupported(config: GuardConfig, state: StateSource) -> str | None:
    """Why the sync-free mode cannot run for this state and configuration (None: it can)."""
    optimizer, scaler = state.optimizer, state.scaler
    if not optimizer_honours_found_inf(optimizer):
        return (f"{type(optimizer).__name__} does not honour found_inf (only fused optimizers do, e.g. "
                "AdamW(fused=True))")
    if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
        return "a GradScaler is enabled (it sets found_inf itself)"
    if config.detection.verify_update:
        return "verify_update copies the state before every step"
    if state.ranks.multi_rank:
        return "several ranks must agree on each step before it is applied"
    return None


class SyncFree:
    """Guard.check in sync-free mode; falls back to the synchronous check (one warning) when unsupported.

    `resolve()` judges the step started last and `start()` launches this one's copies; the Guard dumps the
    Incident resolve() returns and applies its policy.

    Args:
        config: the Guard's configuration; detectors: its StepDetectors; history: the history this mode feeds.
        state: the state source (optimizer, scheduler, grad norm, the pre-step state of a non-finite step).
        add_hook: keeps the optimizer step hook this mode installs (the Guard removes it at close()).
    """

    def __init__(self, config: GuardConfig, detectors: StepDetectors, state: StateSource, history: History,
                 add_hook: Callable[[Any], None]):
        self.config, self.detectors, self.state, self.history = config, detectors, state, history
        self.add_hook = add_hook
        self.pending: Pending | None = None
        self._active: bool | None = None  # decided at the first check

    def active(self) -> bool:
        """Whether this Guard can run sync-free (decided once, at the first check; one warning if not)."""
        if self._active is None:
            reason = unsupported(self.config, self.state)
            self._active = reason is None
            if reason:
                log.warning("forensics: GuardConfig.detection.sync_free is ignored: %s; using the synchronous check",
                            reason)
            else:
                self.add_hook(self.state.optimizer.register_step_post_hook(_clear_found_inf))
        return self._active

    def start(self, record: StepRecord, grad_norm: Any, step: int) -> None:
        """This step's half of the sync-free check (call only when active(), after resolve())."""
        state = self.state
        optimizer = state.optimizer
        if grad_norm is None:
            grad_norm = state.grad_norm()
        param = next((p for group in optimizer.param_groups for p in group["params"]), None)
        device = param.device if param is not None else torch.device("cpu")
        values = [*record.losses, grad_norm]
        device_index = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.device == device]
        # Off-device values are read on the host; a Python number is never moved to the device (a pageable
        # host->device copy waits for the stream like a sync).
        host = {i: None if v is None else float(v.detach().float().mean()) if isinstance(v, torch.Tensor)
                else float(v) for i, v in enumerate(values) if i not in device_index}
        host_bad = any(v is not None and not math.isfinite(v) for v in host.values())
        pinned = device.type == "cuda"
        if device_index:
            stacked = torch.stack([values[i].detach().float().mean() for i in device_index])
            found_inf = (~torch.isfinite(stacked)).any().float()
            if host_bad:
                found_inf = torch.ones((), device=device)
            buffer = torch.empty(len(device_index), dtype=torch.float32, pin_memory=pinned)
            buffer.copy_(stacked, non_blocking=pinned)
        else:
            found_inf = torch.full((), float(host_bad), device=device)
            buffer = torch.empty(0)
        optimizer.found_inf = found_inf  # the fused step skips the update (and undoes its step count) when 1
        optimizer.grad_scale = None
        landed = DeviceFence([device] if pinned else [])
        hyper = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
                 for group in optimizer.param_groups]
        self.pending = Pending(step, record, len(record.losses), host, device_index, buffer, landed,
                               snapshot.current_lr(optimizer), snapshot.scheduler_state(state.scheduler), hyper,
                               record.divisor(self.config.detection.loss_divisor))

    def quarantine(self) -> None:
        """A CUDA error poisoned the context: the pending step's pinned buffer is never freed (see
        forensics.device_sync.quarantine) and the step is not judged (its values can no longer be read)."""
        if self.pending is not None:
            quarantine([self.pending.buffer])
            self.pending = None

    def resolve(self, step: int) -> Incident | None:
        """Judges the pending step, if any (`step`: the one being checked now): history and detectors fed, its
        Incident returned when a detector fired."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.landed.wait()
        values: list[float | None] = [None] * (pending.n_losses + 1)
        for i, v in pending.host.items():
            values[i] = v
        for i, v in zip(pending.device_index, pending.buffer.tolist()):
            values[i] = v
        losses = cast("list[float]", values[:pending.n_losses])  # all filled in above
        return self._judge(pending, losses, values[pending.n_losses], step)

    def _judge(self, pending: Pending, losses: list[float], norm: float | None, step: int) -> Incident | None:
        divisor = pending.divisor
        step_loss = sum(losses) / divisor if losses else None
        trigger = self.detectors.detect(losses, norm, step_loss, None)
        spike = trigger is not None and trigger.kind.spike
        self.history.append(pending.step, step_loss, norm, pending.lr, None,
                            clipped(norm, self.config.detection.max_grad_norm), trigger is not None and not spike,
                            self.detectors.note_suppressed(step))
        if trigger is None:
            return None
        policy = self.config.policy_for(trigger.kind)
        if spike:  # applied before it was seen: its pre-step state is gone, so it is not dumped
            return Incident(dataclasses.replace(trigger, detail=trigger.detail + SPIKE_LATE), pending.step,
                            pending.record, losses, norm, divisor, policy, undumpable=SPIKE_NOT_DUMPED)
        trigger = dataclasses.replace(trigger, detail=trigger.detail + LATE)
        state = self.state.collect(snapshot.HostCopy(enabled=False))
        for group, hyper in zip(state["optimizer"]["param_groups"], pending.hyper):
            group.update({k: snapshot.plain(v) for k, v in hyper.items()})
        return Incident(trigger, pending.step, pending.record, losses, norm, divisor, policy, state=state,
                        scheduler=pending.scheduler)


def _clear_found_inf(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step post-hook: the attributes apply to one step only (GradScaler deletes them the same way)."""
    for name in ("found_inf", "grad_scale"):
        if hasattr(optimizer, name):
            delattr(optimizer, name)
