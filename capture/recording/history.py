"""Ring buffer of cheap per-step scalars (loss, grad norm, lr, loss scale, clipping) for the dump, and a
compact summary of the whole run since step 0 (its first losses, its minimum, how often clipping fired),
so replay can tell a run that diverged long ago from a step that broke a healthy one."""

from __future__ import annotations

import math
from typing import Any, Callable
from collections import deque

FIRST_STEPS = 16  # the run's first finite losses / grad norms kept whole: its baseline

FIELDS = ("step", "loss", "grad_norm", "lr", "loss_scale", "clipped", "skipped", "suppressed")


class History:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._rows: deque[tuple] = deque(maxlen=capacity)
        self.listener: Callable[..., None] | None = None
        """Also given each row (the run log: capture/recording/run_log.py)."""
        self._summary: dict[str, Any] = {
            "steps": 0,
            "first_step": None,
            "first_losses": [],
            "first_grad_norms": [],
            "min_loss": None,
            "min_loss_step": None,
            "clipped_steps": 0,
            "skipped_steps": 0,
        }

    def append(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None,
        lr: float | None,
        loss_scale: float | None,
        clipped: bool | None,
        skipped: bool,
        suppressed: str | None = None,
    ) -> None:
        """`suppressed`: the trigger kind warm-up kept from firing at this step (None: none)."""
        self._rows.append((step, loss, grad_norm, lr, loss_scale, clipped, skipped, suppressed))
        if self.listener is not None:
            self.listener(step, loss, grad_norm, lr, loss_scale, clipped, skipped, suppressed)
        summary = self._summary
        summary["steps"] += 1
        if summary["first_step"] is None:
            summary["first_step"] = step
        if loss is not None and math.isfinite(loss):
            if len(summary["first_losses"]) < FIRST_STEPS:
                summary["first_losses"].append(loss)
            if summary["min_loss"] is None or loss < summary["min_loss"]:
                summary["min_loss"], summary["min_loss_step"] = loss, step
        if grad_norm is not None and math.isfinite(grad_norm) and len(summary["first_grad_norms"]) < FIRST_STEPS:
            summary["first_grad_norms"].append(grad_norm)
        summary["clipped_steps"] += bool(clipped)
        summary["skipped_steps"] += bool(skipped)

    def to_dict(self) -> dict:
        columns = list(zip(*self._rows)) if self._rows else [()] * len(FIELDS)
        return {
            "capacity": self.capacity,
            **{name: list(col) for name, col in zip(FIELDS, columns)},
            "summary": {k: list(v) if isinstance(v, list) else v for k, v in self._summary.items()},
        }

    def __len__(self) -> int:
        return len(self._rows)
