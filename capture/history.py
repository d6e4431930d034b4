"""Ring buffer of cheap per-step scalars (loss, grad norm, lr, loss scale, clipping) for the dump."""

from __future__ import annotations

from collections import deque

FIELDS = ("step", "loss", "grad_norm", "lr", "loss_scale", "clipped", "skipped", "suppressed")


class History:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._rows: deque[tuple] = deque(maxlen=capacity)

    def append(self, step: int, loss: float | None, grad_norm: float | None, lr: float | None,
               loss_scale: float | None, clipped: bool | None, skipped: bool, suppressed: str | None = None) -> None:
        """`suppressed`: the trigger kind warm-up kept from firing at this step (None: none)."""
        self._rows.append((step, loss, grad_norm, lr, loss_scale, clipped, skipped, suppressed))

    def to_dict(self) -> dict:
        columns = list(zip(*self._rows)) if self._rows else [()] * len(FIELDS)
        return {"capacity": self.capacity, **{name: list(col) for name, col in zip(FIELDS, columns)}}

    def __len__(self) -> int:
        return len(self._rows)
