"""Multi-rank Guard (torch DDP, and the base of the Accelerate / DeepSpeed guards): every rank triggers on the same step.

One all-reduce per step carries three numbers per rank: whether the rank saw a real fault (a non-finite
loss, or a non-finite gradient norm that is not an ordinary loss-scaler overflow), its step loss, and
(for sharded optimizers) the squared norm of the gradient shard it holds. Every rank then runs the
spike detectors on the SAME global values, so spikes are agreed too, and a sharded state gather
(a collective) is entered by all ranks or by none. After the local write starts there is no collective.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from capture.config import GuardConfig
from capture.guard import Guard, StepRecord, Trigger

log = logging.getLogger(__name__)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameter names a one-GPU replay will see: strips DDP / DataParallel / torch.compile."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def deferred_termination() -> Iterator[None]:
    """Holds SIGTERM back while a rank writes its dump, then lets it act.

    When one rank dies, torchrun sends SIGTERM to the others (and SIGKILL 30 s later). A rank halfway
    through its own dump would otherwise leave it unfinished. Only the main thread can install handlers;
    elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum, frame):  # noqa: ARG001
        received.append(signum)
        log.warning("forensics: SIGTERM received while writing the dump; finishing the dump first")

    try:
        previous = signal.signal(signal.SIGTERM, hold)
    except (ValueError, OSError):  # not allowed here (embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            signal.raise_signal(signal.SIGTERM)


@dataclass(frozen=True)
class Agreement:
    """What the step's all-reduce told every rank (identical on all ranks)."""

    fault: bool  # some rank saw a non-finite loss, or a non-finite gradient that is not a scaler overflow
    loss_fault: bool  # some rank saw a non-finite loss (that rank's data is the first suspect)
    step_loss: float | None  # the mean over ranks (that recorded losses) of their finite step losses
    grad_norm: float | None  # the global norm assembled from shards (sharded optimizers only)


class DistributedGuard(Guard):
    """Guard for multi-rank jobs; identical to Guard in a one-process run.

    Differences from Guard: the model may be passed wrapped (DDP / compile: names come from the inner
    module); losses, gradient norms and the fault flag are agreed in one all-reduce so all ranks trigger
    on the same step, spikes included; a SIGTERM that arrives while a rank writes its dump waits
    until the dump is complete.

    Args:
        model, optimizer, scheduler, scaler, config, loss_fn: as for Guard.
    Example:
        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)           # doctest: +SKIP
        >>> guard = DistributedGuard(ddp, optimizer, scheduler, config=GuardConfig(dump_dir="dumps"))  # doctest: +SKIP
        >>> # then the Guard loop: record_batch, record_loss, check(grad_norm=clip_grad_norm_(...))
    """

    sharded_grad_norm = False
    """True when the grad norm passed to check() is the norm of this rank's shard only (ZeRO)."""
    collective_state = False
    """True when collect_state() is a collective (every rank must call it on the same trigger)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, scheduler: Any = None, scaler: Any = None, *,
                 config: GuardConfig | None = None, loss_fn: Callable | None = None,
                 autocast: dict | None = None):
        super().__init__(unwrap_model(model), optimizer, scheduler, scaler, config=config, loss_fn=loss_fn)
        self.autocast = autocast
        """The autocast a framework applies inside the model's forward (where the loop cannot see it)."""
        self.integration: dict = {"framework": "torch"}
        """Written to the manifest's `distributed` section: framework, ZeRO stage, how state was gathered."""
        self._agreed: Agreement | None = None
        self._state_collections = 0

    # -- recording -------------------------------------------------------------------------------
    def record_loss(self, loss: Any) -> None:
        super().record_loss(loss)
        record = self._current
        if self.autocast and record is not None and not (record.autocast or {}).get("enabled"):
            record.autocast = dict(self.autocast)

    # -- the one collective of the step ----------------------------------------------------------
    def _agree(self, stacked: torch.Tensor, host: list, on_device: list[int]) -> torch.Tensor:
        if self.world_size <= 1 or not _distributed():
            return stacked
        n = len(host) - 2  # host = [losses..., grad norm, loss scale]
        device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" \
            else torch.device("cpu")
        values = torch.tensor([v if isinstance(v, float) else float("nan") for v in host],
                              dtype=torch.float64, device=device)
        if on_device:
            values[on_device] = stacked.to(device=device, dtype=torch.float64)
        losses, norm, scale = values[:n], values[n], values[n + 1]
        scaler_may_skip = ~torch.isnan(scale) & (scale > self.config.min_loss_scale)
        loss_fault = (~torch.isfinite(losses)).any()
        grad_fault = ~torch.isfinite(norm) & ~scaler_may_skip
        divisor = float(self.config.loss_divisor or max(n, 1))
        step_loss = torch.where(torch.isfinite(losses), losses, torch.zeros_like(losses)).sum() / divisor
        shard_sq = norm * norm if self.sharded_grad_norm else torch.zeros_like(norm)
        has_losses = torch.ones_like(norm) if n else torch.zeros_like(norm)
        stats = torch.stack([loss_fault.double(), grad_fault.double(), step_loss, has_losses, shard_sq])
        torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.SUM)
        fetched = torch.cat([values, stats]).tolist()  # the one device->host transfer of the step
        loss_faults, grad_faults, loss_sum, ranks_with_losses, norm_sq = fetched[-5:]
        faults = loss_faults + grad_faults
        global_norm = math.sqrt(norm_sq) if self.sharded_grad_norm else None
        step_loss_mean = loss_sum / ranks_with_losses if ranks_with_losses else None
        self._agreed = Agreement(faults > 0, loss_faults > 0, step_loss_mean, global_norm)
        if global_norm is not None:
            fetched[n] = global_norm
            if n not in on_device:
                host[n] = global_norm
        return torch.tensor([fetched[i] for i in on_device] + [1.0 if faults > 0 else 0.0], dtype=torch.float64)

    def _detect(self, losses: list[float], norm: float, step_loss: float | None,
                loss_scale: float | None) -> Trigger | None:
        agreed, self._agreed = self._agreed, None
        if agreed is None:
            return super()._detect(losses, norm, step_loss, loss_scale)
        if agreed.fault:
            # Only the non-finite checks: the spike windows must stay identical on every rank. A rank
            # whose own losses are finite while another rank's loss is not only inherited the fault
            # (through the gradient all-reduce): its trigger is the non-local one the Guard adds.
            for index, value in enumerate(losses):
                if not math.isfinite(value):
                    return Trigger("nonfinite_loss", value, None, index, f"loss of micro-batch {index} is {value}")
            if agreed.loss_fault or math.isfinite(norm):
                return None
            return super()._detect([], norm, None, loss_scale)
        # Every rank feeds its detectors the same global values, so their windows stay identical.
        return super()._detect(losses, norm, agreed.step_loss, loss_scale)

    # -- writing ---------------------------------------------------------------------------------
    def _maybe_dump(self, trigger: Trigger, record: StepRecord, losses: list[float], norm: float,
                    divisor: float, policy: str, state: dict | None = None) -> tuple[Path | None, str | None]:
        # A collective state gather must be entered by every rank or none: count attempts, which are
        # the same on every rank, not successful writes, which are not.
        if self.collective_state and self._state_collections >= self.config.max_dumps:
            return None, f"the cap of {self.config.max_dumps} dumps per run is reached (GuardConfig.max_dumps)"
        with deferred_termination():
            return super()._maybe_dump(trigger, record, losses, norm, divisor, policy, state)

    def collect_state(self, copy) -> dict:
        self._state_collections += 1
        return super().collect_state(copy)

    def _manifest(self, trigger: Trigger, record: StepRecord, losses: list[float], norm: float,
                  divisor: float) -> dict:
        manifest = super()._manifest(trigger, record, losses, norm, divisor)
        manifest["distributed"] = {**self.integration, "world_size": self.world_size,
                                   "state": "full on every rank (replayable alone)"}
        return manifest
