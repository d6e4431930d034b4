"""Multi-rank support for the Guard: the one all-reduce per step that makes every rank trigger on the same step.

Under torchrun each rank runs its own Guard. Left alone, a rank would judge only what it sees, so a
spike on one rank's data would be dumped by that rank alone, and a sharded state gather (a
collective) entered by one rank would hang. `agree` folds what every rank needs to know into one
all-reduce of eight numbers per step: whether the rank saw a real fault (a non-finite loss, or a
non-finite gradient norm that is not an ordinary loss-scaler overflow), whether that fault was a
non-finite loss, its step loss and whether it recorded losses, its finite gradient norm and whether
it has one, (sharded optimizers) the squared norm of its gradient shard, and whether one of its precursor
statistics fired (sharded state: every rank then dumps the step together). Every rank then runs its
spike detectors on the same global values.

The run ID every rank agrees on is capture/state/run_id.py's, `unwrap_model` capture/state/unwrap.py's, the signals held
while a rank writes its dump capture/dumping/signals.py's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from forensics.capture.state.run_id import collective_device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Agreement:
    """What the step's all-reduce told every rank (identical on all ranks)."""

    fault: bool  # some rank saw a non-finite loss, or a non-finite gradient that is not a scaler overflow
    loss_fault: bool  # some rank saw a non-finite loss (that rank's data is the first suspect)
    step_loss: float | None  # the mean over ranks (that recorded losses) of their finite step losses
    grad_norm: float | None  # sharded: the global norm assembled from shards; else the mean of the ranks' finite norms
    precursor: bool = False  # some rank's precursor statistic fired at its last check (capture/precursors/monitor.py)


def device_scalar(value: Any, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor on `device` holding `value` (a loss, a norm; None: NaN), made without waiting on the device: a
    floating device scalar is used as it is (the caller stacks and casts once), another device tensor averaged in fp32;
    a CPU tensor or a Python number is read on the host and filled in as float64 (a pageable host->device copy would
    wait for the stream). The result may be shared (a constant): stack or copy it, never write into it."""
    if isinstance(value, torch.Tensor):
        value = value.detach() if value.requires_grad else value  # record_loss keeps losses detached: no second view
        if value.device == device:
            return value if value.dim() == 0 and value.is_floating_point() else value.float().mean()
        if value.device.type != "cpu":
            return value.float().mean().to(device)
        value = float(value.float().mean())
    if value is None:
        return constant(math.nan, device)
    return torch.full((), float(value), dtype=torch.float64, device=device)


_CONSTANTS = (0.0, 1.0, math.nan)
_constants: dict[torch.device, torch.Tensor] = {}


def constant(value: float, device: torch.device) -> torch.Tensor:
    """0, 1 or NaN as a float64 0-dim tensor on `device`: a view of a vector made once per device, so that a step's
    numbers are stacked from it without launching a fill for each constant (on a GPU every launch costs the host
    tens of microseconds). Never write into it."""
    vector = _constants.get(device)
    if vector is None:  # filled on the device: a host->device copy of a pageable list would wait for the stream
        vector = torch.zeros(len(_CONSTANTS), dtype=torch.float64, device=device)
        vector[1].fill_(1.0)
        vector[2].fill_(math.nan)
        _constants[device] = vector
    return vector[2 if math.isnan(value) else _CONSTANTS.index(value)]


def agree(
    values: list[Any],
    n_losses: int,
    *,
    divisor: float,
    min_loss_scale: float,
    sharded_grad_norm: bool,
    precursor_fired: bool = False,
) -> tuple[list[float | None], Agreement]:
    """The step's one all-reduce and its one device->host transfer (launch() and settle(), read at once).

    Args:
        values: `[*micro-batch losses, grad norm, loss scale]`, each a tensor, a number or None (unknown).
        n_losses: how many of `values` are losses.
        divisor: what the step loss divides the summed micro-batch losses by.
        min_loss_scale: a non-finite gradient with a loss scale above this is the scaler's ordinary skip.
        sharded_grad_norm: the grad norm is this rank's shard's; the global one is assembled here.
        precursor_fired: a precursor statistic of this rank fired at its last check and waits for every rank.
    Returns:
        `values` as host numbers (None stays None; the grad norm is the global one when sharded), and
        the Agreement, identical on every rank.
    """
    launched = launch(
        values,
        n_losses,
        divisor=divisor,
        min_loss_scale=min_loss_scale,
        sharded_grad_norm=sharded_grad_norm,
        precursor_fired=precursor_fired,
    )
    return settle(launched.tolist(), values, n_losses, sharded_grad_norm)  # the one device->host transfer


STATS = 8
"""The summed statistics at the end of launch()'s vector (settle() reads them)."""


def launch(
    values: list[Any],
    n_losses: int,
    *,
    divisor: float,
    min_loss_scale: float,
    sharded_grad_norm: bool,
    precursor_fired: bool = False,
) -> torch.Tensor:
    """The step's all-reduce, queued and not read: `[*values, *STATS summed statistics]` as float64 on the
    collective device (agree()'s arguments). The sync-free check derives its device flags from it and reads it one
    step later (capture/detection/sync_free.py). A dozen small operators (each a kernel launch on a GPU, where a host-bound
    step pays for every one): the values cleaned of non-finite ones once, the flags compared against that."""
    device = collective_device()
    source = next((v.device for v in values if isinstance(v, torch.Tensor) and v.device.type != "cpu"), device)
    if device.type != "cpu":
        source = device
    vector = torch.stack([device_scalar(v, source) for v in values]).to(device, torch.float64)  # gloo + CUDA
    # losses: the one copy
    cleaned = torch.nan_to_num(vector, nan=0.0, posinf=0.0, neginf=0.0)  # each value, or 0 where it is not finite
    bad = (vector != cleaned).double()  # 1 where a value is not finite (a finite value equals its cleaned self)
    zero, one = constant(0.0, device), constant(1.0, device)
    loss_fault = bad[:n_losses].amax() if n_losses else zero
    if values[n_losses] is None:  # no gradients to measure: not a fault, no shard
        grad_fault, shard_sq, norm_sum, has_norm = zero, zero, zero, zero
    else:
        norm = vector[n_losses]
        grad_fault = bad[n_losses]
        if values[n_losses + 1] is not None:  # with a loss scaler, an overflow above the floor is its skip
            grad_fault = grad_fault * ~(vector[n_losses + 1] > min_loss_scale)
        shard_sq = norm * norm if sharded_grad_norm else zero
        norm_sum, has_norm = cleaned[n_losses], 1.0 - bad[n_losses]
    step_loss = cleaned[:n_losses].sum() / divisor
    stats = torch.stack(
        [
            loss_fault,
            grad_fault,
            step_loss,
            one if n_losses else zero,
            shard_sq,
            norm_sum,
            has_norm,
            one if precursor_fired else zero,
        ]
    )
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.SUM)
    return torch.cat([vector, stats])


def agreed_on_device(
    launched: torch.Tensor, sharded_grad_norm: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From launch()'s vector, on its device: (some rank saw a fault, the agreed step loss, the agreed grad norm), the
    numbers settle() gives the host (the same float64 operations). A loss or norm no rank had is NaN (0 / 0), so no
    comparison with it is true: settle() has None there."""
    loss_faults, grad_faults, loss_sum, ranks_with_losses, norm_sq, norms, ranks_with_norm, _ = launched[-STATS:]
    step_loss = loss_sum / ranks_with_losses
    norm = norm_sq.sqrt() if sharded_grad_norm else norms / ranks_with_norm
    return (loss_faults + grad_faults) > 0, step_loss, norm


def settle(
    fetched: list[float], values: list[Any], n_losses: int, sharded_grad_norm: bool
) -> tuple[list[float | None], Agreement]:
    """launch()'s vector read on the host (`fetched`) as agree() returns it: the host numbers and the Agreement."""
    loss_faults, grad_faults, loss_sum, ranks_with_losses, norm_sq, norms, ranks_with_norm, precursors = fetched[
        -STATS:
    ]
    host = [None if v is None else fetched[i] for i, v in enumerate(values)]
    agreed_norm: float | None
    if sharded_grad_norm:
        agreed_norm = host[n_losses] = math.sqrt(norm_sq)
    else:
        agreed_norm = norms / ranks_with_norm if ranks_with_norm else None
    agreement = Agreement(
        fault=loss_faults + grad_faults > 0,
        loss_fault=loss_faults > 0,
        step_loss=loss_sum / ranks_with_losses if ranks_with_losses else None,
        grad_norm=agreed_norm,
        precursor=precursors > 0,
    )
    return host, agreement
