"""Whether the optimizer stepped since the last check(): tells an exception raised inside the update from one
raised after it (the loop's data loading or other user code between two steps).

Optimizer step hooks (`register_step_pre_hook` / `register_step_post_hook`, torch >= 2.0) are set on the torch
optimizer that does the update: a wrapper (Accelerate's AcceleratedOptimizer, DeepSpeed's ZeRO optimizer,
anything holding the real one as `.optimizer`) is unwrapped first, so the hooks fire whoever calls step() —
the loop, GradScaler.step (which skips the update on an overflow: no hook fires, and none should), fused or
foreach implementations alike. Where no such optimizer is found, `known` is False and the Guard labels an
exception after check() as before (during the optimizer, the state possibly partial), with the reason logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from forensics.core.kinds import Phase, StateHolds

log = logging.getLogger(__name__)

MAX_WRAPPERS = 4  # AcceleratedOptimizer -> DeepSpeed's ZeRO optimizer -> torch optimizer: deeper is not a wrapper


@dataclass(frozen=True)
class AfterCheck:
    """Where an exception raised after check() happened, and what the model state then holds."""

    phase: Phase
    state_holds: StateHolds


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer that performs the update: `optimizer` itself, or the one it wraps as `.optimizer`."""
    found = None
    for _ in range(MAX_WRAPPERS):
        if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "register_step_post_hook"):
            found = optimizer
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return found


class OptimizerSteps:
    """Follows the optimizer's steps through its step hooks; `checked()` starts a new step."""

    def __init__(self, optimizer: Any, add_hook: Callable[[Any], None]):
        self.started = False
        self.finished = False
        self.why_unknown: str | None = None
        target = torch_optimizer(optimizer)
        if target is None:
            self.why_unknown = (
                f"{type(optimizer).__name__} is not (and does not wrap) a torch.optim.Optimizer with "
                "step hooks (torch >= 2.0)"
            )
            log.info("forensics: %s; an exception after check() is recorded as during the optimizer", self.why_unknown)
            return
        try:
            add_hook(target.register_step_pre_hook(self._before))
            add_hook(target.register_step_post_hook(self._after))
        except Exception as exc:  # noqa: BLE001 - an optimizer that refuses hooks: the Guard works without them
            self.why_unknown = f"the optimizer refused step hooks ({type(exc).__name__}: {exc})"
            log.info("forensics: %s; an exception after check() is recorded as during the optimizer", self.why_unknown)

    @property
    def known(self) -> bool:
        """The hooks are in place: the Guard knows whether the optimizer stepped."""
        return self.why_unknown is None

    def stepped(self) -> bool | None:
        """Whether the optimizer stepped since the last check(); None when the hooks are not in place."""
        return self.started if self.known else None

    def checked(self) -> None:
        """check() ran: the update that follows belongs to the step just checked."""
        self.started = self.finished = False

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.started, self.finished = True, False

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.finished = True

    def after_check(self) -> AfterCheck:
        """Where an exception raised after check() (and before the next record_batch) happened."""
        if not self.known or (self.started and not self.finished):
            return AfterCheck(Phase.OPTIMIZER, StateHolds.MAYBE_PARTIAL)
        return AfterCheck(Phase.BETWEEN_STEPS, StateHolds.AFTER_UPDATE if self.finished else StateHolds.PRE_STEP)
