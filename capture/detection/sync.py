"""The Guard's synchronous check (the default mode): the step's numbers read on the host in one transfer, the
detectors asked, the history and flight recorder fed, and a trigger turned into an `Incident`.

GuardConfig.detection.sync_free replaces it with capture/detection/sync_free.py. Both take what they read
(configuration, state source, recorders) and return an `Incident` or None: the Guard dumps it and applies its policy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from forensics.capture.detection.agreement import Agreement, agree
from forensics.capture.detection.detectors import StepDetectors, clipped
from forensics.capture.config import GuardConfig
from forensics.capture.precursors import monitor
from forensics.capture.precursors.monitor import PrecursorMonitor
from forensics.capture.recording.history import History
from forensics.capture.recording.incident import Incident, StepRecord
from forensics.capture.recording.window import FlightRecorder, WindowStep
from forensics.capture.state import sharding, snapshot
from forensics.capture.state.host_snapshots import HostSnapshots
from forensics.capture.state.source import StateSource
from forensics.core.kinds import Policy
from forensics.core import thirdparty
from forensics.core.thirdparty import grad_scaler_scale

log = logging.getLogger(__name__)


class SyncCheck:
    """check() between backward and optimizer.step(), reading the step's numbers before it returns.

    Args:
        config: the Guard's configuration; detectors: its StepDetectors.
        state: the state source (optimizer, scaler, the grad norm, the state a host snapshot copies).
        history, window, snapshots: the recorders this check feeds.
        precursors: the precursor monitor whose row rides on the step's transfer (None: off).
    """

    def __init__(
        self,
        config: GuardConfig,
        detectors: StepDetectors,
        state: StateSource,
        history: History,
        window: FlightRecorder,
        snapshots: HostSnapshots,
        precursors: PrecursorMonitor | None,
    ):
        self.config, self.detectors, self.state, self.precursors = config, detectors, state, precursors
        self.history, self.window, self.snapshots = history, window, snapshots
        self.unscaled_by: float | None = None
        """The loss scale the Guard divided the step's grad norm by at the last check (its own norm, or one the loop
        passed while the gradients were still scaled; None: none divided)."""
        self.scaled_norm_said = False
        self.loop_norm = False
        """The last check's grad norm came from the loop, with a GradScaler on."""

    def check(self, record: StepRecord, grad_norm: Any, step: int) -> Incident | None:
        """The step's Incident when a detector fired (the Guard dumps it and applies its policy), else None."""
        config, state = self.config, self.state
        losses, norm, loss_scale, agreed = self._gather(record, grad_norm, step)
        divisor = record.divisor(config.detection.loss_divisor)
        step_loss = sum(losses) / divisor if losses else None
        scaler_overflow = loss_scale is not None and norm is not None and not math.isfinite(norm)
        trigger = self.detectors.detect(losses, norm, step_loss, loss_scale, agreed)
        policy = config.policy_for(trigger.kind) if trigger is not None else None
        # every rank of a sharded state dumps a precursor together (or none does), with a monitor of its own or not
        agreed_precursor = monitor.agreed_trigger(self.precursors, agreed, other=trigger is not None)
        if agreed_precursor is not None:
            trigger, policy = agreed_precursor, Policy.CONTINUE
        lr, was_clipped = snapshot.current_lr(state.optimizer), clipped(norm, config.detection.max_grad_norm)
        self.history.append(
            step,
            step_loss,
            norm,
            lr,
            loss_scale,
            was_clipped,
            policy is Policy.SKIP or scaler_overflow,
            self.detectors.note_suppressed(step, fault=trigger is not None),
        )
        self.window.append(
            WindowStep(
                step, list(record.sample_ids), list(record.rng), lr, loss_scale, divisor, step_loss, norm, was_clipped
            )
        )
        if trigger is None or policy is None:  # policy is set whenever trigger is
            self.snapshots.settle()
            if self.snapshots.due(step):
                take_snapshot(state, self.snapshots, step)
            return None
        incident = Incident(
            trigger,
            step,
            record,
            losses,
            norm,
            divisor,
            policy,
            agreed=state.ranks.multi_rank,
            grad_norm_unscaled_by=self.unscaled_by,
        )
        if (
            self.loop_norm
            and loss_scale
            and self.unscaled_by is None
            and norm is not None
            and math.isfinite(norm)
            and not state.ranks.multi_rank
        ):  # one process: its own norm is the whole norm
            incident = self._loop_norm_units(incident, loss_scale)
        return incident

    def _loop_norm_units(self, incident: Incident, loss_scale: float) -> Incident:
        """A step that is dumped, whose grad norm the loop passed with a GradScaler on: that norm compared with the
        gradients' own norm, measured now (a read on the dumping path only, never on a healthy step). A loop norm that
        is the loss scale times the gradients' norm was taken before `scaler.unscale_` (and passed after it): said
        once, and the dump records it unscaled (`loss.grad_norm_unscaled_by`)."""
        try:
            own = sharding.host_norm(self.state.grad_norm())
            own = float(own) if own is not None else None
        except Exception:  # noqa: BLE001 - a comparison for advice; the dump goes on without it
            return incident
        norm = incident.grad_norm
        if not own or norm is None or not math.isfinite(own) or abs(norm / (own * loss_scale) - 1) > 1e-3:
            return incident
        if not self.scaled_norm_said:
            self.scaled_norm_said = True
            log.warning(
                "forensics: step %d: the grad norm check() got (%.6g) is the loss scale (%g) times the "
                "gradients' norm: it was taken before scaler.unscale_(optimizer), and the history holds such "
                "norms. Fix: call scaler.unscale_(optimizer) before clip_grad_norm_ (whose threshold then "
                "applies to unscaled gradients); this dump records the unscaled norm. Logged once",
                incident.step,
                norm,
                loss_scale,
            )
        return dataclasses.replace(incident, grad_norm=norm / loss_scale, grad_norm_unscaled_by=loss_scale)

    def loop_norm_unscaled(self, grad_norm: Any, step: int) -> tuple[Any, bool]:
        """The loop's grad norm in unscaled units: a norm passed while a GradScaler still holds the gradients scaled
        (check() before `scaler.unscale_(optimizer)`) is the scale times too large; it is divided by the scale (its
        device tensor: no sync) and the loop is told once how to fix it. (grad norm, whether it was divided)."""
        scale = thirdparty.grads_scaled_by(self.state.scaler, self.state.optimizer)
        if scale is None:
            return grad_norm, False
        if not self.scaled_norm_said:
            self.scaled_norm_said = True
            log.warning(
                "forensics: step %d: check(grad_norm=...) got the norm of gradients the GradScaler still holds "
                "scaled (x the loss scale): the history and spike detection would see it that many times too "
                "large. Fix: call scaler.unscale_(optimizer) before clip_grad_norm_ and check(); meanwhile the "
                "Guard divides the scale out (the dump's loss.grad_norm_unscaled_by). Logged once",
                step,
            )
        return _divided(grad_norm, scale), True

    def _gather(
        self, record: StepRecord, grad_norm: Any, step: int
    ) -> tuple[list[float], float | None, float | None, Agreement | None]:
        """One device->host transfer of per-micro-batch losses, grad norm and loss scale (and, with several
        ranks, the step's one all-reduce: capture/detection/agreement.py).

        Python numbers stay on the host: building a device tensor from one would be a pageable
        host->device copy, which waits for the stream just like a sync.
        """
        state, precursors = self.state, self.precursors
        sharded = own_unscaled = False
        passed = grad_norm is not None
        if not passed:
            grad_norm, sharded = state.grad_norm(), state.sharded_grad_norm
            own_unscaled = state.own_norm_unscaled
        grad_norm = sharding.host_norm(grad_norm)
        self.loop_norm = passed and state.scaler is not None
        if self.loop_norm:
            grad_norm, own_unscaled = self.loop_norm_unscaled(grad_norm, step)
        scaler = state.scaler
        scale = grad_scaler_scale(scaler) if scaler is not None and scaler.is_enabled() else None
        values: list[Any] = [*record.losses, grad_norm, scale]
        n = len(record.losses)
        row = precursors.pending_row() if precursors is not None else None  # the last sampled step's
        agreed = None
        if state.ranks.multi_rank:
            host, agreed = agree(
                values,
                n,
                divisor=record.divisor(self.config.detection.loss_divisor),
                min_loss_scale=self.config.detection.min_loss_scale,
                sharded_grad_norm=sharded,
                precursor_fired=precursors is not None and precursors.awaiting is not None,
            )
            row_values = row.tolist() if row is not None else None  # done on the device long since: no wait
        else:
            host, row_values = host_numbers(values, row)
        if precursors is not None:
            if row_values is not None:
                precursors.receive(row_values)
            precursors.launch_row(step)  # after the transfer: its device work overlaps the optimizer step
        self.unscaled_by = host[n + 1] if own_unscaled else None
        return host[:n], host[n], host[n + 1], agreed  # type: ignore[return-value]  # a recorded loss is never None
        # (not typing.cast: a Python call per step)


def _divided(norm: Any, scale: torch.Tensor) -> Any:
    """`norm` (a tensor or a number) divided by the GradScaler's scale tensor, on the norm's device (no host read)."""
    if isinstance(norm, torch.Tensor):
        return norm / scale.reshape(()).to(norm.device)
    return torch.as_tensor(float(norm), dtype=torch.float32) / scale.reshape(()).cpu().float()


def take_snapshot(state: StateSource, snapshots: HostSnapshots, step: int) -> None:
    """GuardConfig.recording.snapshot_every: host copies of the state the state source names; turned off, with the
    reason, when it names none or copying fails (a snapshot is a convenience; the job goes on without it)."""
    try:
        references, why_not = state.snapshot()
        if references is None:
            snapshots.turn_off(why_not or "no state to snapshot")
        else:
            snapshots.take(step, references)
    except Exception as exc:  # noqa: BLE001
        snapshots.turn_off(f"copying the state failed ({type(exc).__name__}: {exc})")


def host_numbers(values: list[Any], row: torch.Tensor | None = None) -> tuple[list[float | None], list[float] | None]:
    """Host numbers for `values` (None: unknown), stacked on their device and read in one transfer, and those of
    `row` (a 1-D tensor: the precursor statistics of a sampled step) read in the same transfer.
    A CPU tensor beside device tensors is read on the host (moving it to the device would wait)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)] + ([row] if row is not None else [])
    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.device == device]
    host = [
        None
        if v is None or i in on_device
        else float(v.detach().float().mean())
        if isinstance(v, torch.Tensor)
        else float(v)
        for i, v in enumerate(values)
    ]
    parts = [stacked_means([values[i] for i in on_device])] if on_device else []
    if row is not None:
        parts.append(row.detach().float().to(device))  # on its device already, unless the model is split
    if not parts:
        return host, None
    fetched = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # the one sync
    for slot, i in enumerate(on_device):
        host[i] = fetched[slot]
    return host, fetched[len(on_device) :] if row is not None else None


def stacked_means(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The mean of each tensor as one fp32 vector, in as few operators as a healthy step allows: scalars (a loss, a
    norm) are stacked as they are (stack promotes their dtypes; one cast after), others averaged in fp32 first."""
    stacked = torch.stack(
        [(t.detach() if t.requires_grad else t) if t.dim() == 0 else t.detach().float().mean() for t in tensors]
    )
    return stacked if stacked.dtype == torch.float32 else stacked.float()
