"""Whether a recorded number and its replayed counterpart differ by a factor the job recorded — the loss scale, the
world size, the gradient-accumulation count — rather than by their values: a norm of gradients still scaled by a
GradScaler (a loop that passes check() clip_grad_norm_'s value before scaler.unscale_, or a dump from before the
Guard measured unscaled norms) reads loss-scale times the replayed one. Such a ratio is a unit, not a failure to
reproduce: fidelity does not compare across it, and the verdict names the factor instead of suspecting hardware."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, TypeGuard

from forensics.core.kinds import ReplayedQuantity
from forensics.replay.load.session import ReplaySession

TOLERANCE = 0.1
"""Relative distance of the ratio from the factor still read as that factor (a replay on other kernels moves the
norm by a few percent; two recorded factors are powers of two apart or more)."""


@dataclass(frozen=True)
class UnitFactor:
    """The recorded factor that explains recorded / replayed."""

    name: str
    """'the loss scale', 'the world size', 'the gradient-accumulation count'."""
    value: float
    recorded_larger: bool
    """True: recorded = value x replayed; False: recorded = replayed / value."""

    def words(self, what: str = "the grad norm") -> str:
        """'the recorded grad norm is the loss scale (65536) times the replayed one'."""
        how = "times" if self.recorded_larger else "divided by"
        return f"the recorded {what} is the replayed one {how} {self.name} ({self.value:g})"


def recorded_factors(session: ReplaySession) -> list[tuple[str, float]]:
    """The factors a replayed number may differ by, from what the dump recorded (a ReplaySession)."""
    factors: list[tuple[str, float]] = []
    if session.loss_scale is not None:
        factors.append(("the loss scale", session.loss_scale))
    world = session.world_size or 1
    if world > 1:
        factors.append(("the world size", float(world)))
    accumulation = len(session.micro_batches)
    if accumulation > 1:
        factors.append(("the gradient-accumulation count", float(accumulation)))
    return factors


def explaining_factor(
    recorded: float | None, replayed: float | None, factors: list[tuple[str, float]]
) -> UnitFactor | None:
    """The recorded factor that recorded / replayed equals (or its inverse), within TOLERANCE; None when none does
    or either number is missing, zero or non-finite."""
    if not _positive(recorded) or not _positive(replayed):
        return None
    ratio = abs(recorded) / abs(replayed)
    for name, value in factors:
        if not _positive(value) or value == 1:
            continue
        for candidate, larger in ((value, True), (1 / value, False)):
            if abs(ratio / candidate - 1) <= TOLERANCE:
                return UnitFactor(name, value, larger)
    return None


def _positive(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value != 0


def unscaled_history(history: dict | None) -> dict | None:
    """The recorded history with each row's grad norm divided by that row's loss scale (a job whose grad norms were
    measured on scaled gradients: ReplaySession.grad_norms_scaled), so its reading and the clipping threshold it
    suggests are in unscaled units. Rows without a positive loss scale keep their norm."""
    if not history or not history.get("grad_norm"):
        return history
    scales = list(history.get("loss_scale") or [])
    norms = []
    for i, norm in enumerate(history["grad_norm"]):
        scale = scales[i] if i < len(scales) else None
        norms.append(norm / scale if _positive(norm) and _positive(scale) and scale > 0 else norm)
    return {**history, "grad_norm": norms}


def to_replay_units(session: ReplaySession, replayed_norm: float | None) -> bool:
    """A grad-norm trigger recorded on gradients a GradScaler still held scaled (the loop passed check() the norm
    before `scaler.unscale_`, or a dump from before the Guard unscaled its own norm): its value and threshold are
    the loss scale times the replay's unscaled norm. They are put into the replay's units (session.trigger,
    recorded_grad_norm, grad_norms_scaled), with a warning, so every stage compares like with like.
    `replayed_norm`: the whole step's replayed grad norm. Returns True when converted."""
    trigger = session.trigger
    if trigger.kind.replayed is not ReplayedQuantity.GRAD_NORM or not trigger.kind.spike or not session.scaler_enabled:
        return False
    scale = [f for f in recorded_factors(session) if f[0] == "the loss scale"]
    value = trigger.value
    unit = explaining_factor(value, replayed_norm, scale)
    if value is None or unit is None or not unit.recorded_larger:
        return False
    divide = unit.value
    session.trigger = replace(
        trigger,
        value=value / divide,
        threshold=trigger.threshold / divide if trigger.threshold else None,
        detail=f"{trigger.detail} (recorded on scaled gradients; / loss scale {divide:g} here)",
    )
    if session.recorded_grad_norm is not None:
        session.recorded_grad_norm = session.recorded_grad_norm / divide
    session.grad_norms_scaled = True
    session.warnings.append(
        f"the recorded grad norm {trigger.value:.4g} was measured on gradients still scaled by "
        f"the GradScaler ({unit.words()}); replay compares unscaled values: recorded value and "
        "threshold are divided by the loss scale"
    )
    return True
