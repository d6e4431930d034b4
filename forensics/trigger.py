"""What fired, as one typed record both sides share: the Guard writes it as the manifest's `trigger` section
(docs/DUMP_FORMAT.md), replay reads it back, and the report carries it (docs/REPORT_FORMAT.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from forensics.format.jsonio import lenient_float
from forensics.kinds import TriggerKind
from forensics.report.wording import trigger_detail


@dataclass(frozen=True)
class Trigger:
    """What made the Guard dump a step.

    `as_dict()` is the stored form (the manifest's `trigger`, `TrainingFaultError.trigger`, `Dump.trigger`);
    `Trigger.from_dict` reads it back.
    """

    kind: TriggerKind
    value: float | None = None
    """The number that fired (the loss, the grad norm; NaN for a step that raised or broke the weights)."""
    threshold: float | None = None
    """The spike threshold it passed, or the loss-scale floor for collapsed-scale overflows; None otherwise."""
    micro_batch: int | None = None
    """0-based index of the micro-batch that fired, when one did."""
    detail: str = ""
    """The detector's one-line explanation (micro-batches 0-based, as in the JSON)."""
    local: bool = True
    """False when this rank only inherited the trigger from another rank."""
    update_change: float | None = None
    """Replay only (a window step whose own update wrecked the weights): the update's relative size."""

    @property
    def message(self) -> str:
        """The detail as people read it: micro-batches counted from 1, as in every report."""
        return trigger_detail(self.as_dict())

    def as_dict(self) -> dict:
        stored = {"kind": self.kind.value, "value": self.value, "threshold": self.threshold,
                  "micro_batch": self.micro_batch, "detail": self.detail, "local": self.local}
        return stored if self.update_change is None else {**stored, "update_change": self.update_change}

    @classmethod
    def from_dict(cls, data: Mapping | None) -> "Trigger":
        """The stored form back (a missing kind reads as `nonfinite_loss`, a missing `local` as true).

        Raises:
            ValueError: an unknown kind.
        """
        data = data or {}
        index = data.get("micro_batch")
        return cls(TriggerKind.parse(data.get("kind") or TriggerKind.NONFINITE_LOSS), lenient_float(data.get("value")),
                   lenient_float(data.get("threshold")),
                   index if isinstance(index, int) and not isinstance(index, bool) else None,
                   str(data.get("detail") or ""), data.get("local", True) is not False,
                   lenient_float(data.get("update_change")))
