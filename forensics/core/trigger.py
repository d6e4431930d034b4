"""What fired, as one typed record both sides share: the Guard writes it as the manifest's `trigger` section
(docs/DUMP_FORMAT.md), `Dump.trigger` reads it back, replay carries it, and the report's `trigger` block is built
from it (forensics/report/tree.py, `TriggerBlock.of`)."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from forensics.format.jsonio import lenient_float
from forensics.core.kinds import TriggerKind

DETAIL_MICRO_BATCH = re.compile(r"\bmicro-batch (\d+)\b")


@dataclass(frozen=True)
class Trigger:
    """What made the Guard dump a step.

    `as_dict()` is the stored form (the manifest's `trigger`, `TrainingFaultError.trigger`); `Trigger.from_dict`
    reads it back (`Dump.trigger`). `trigger["kind"]` still reads the stored form's keys, for code written when
    `Dump.trigger` was a dict (deprecated: use the attributes).
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
        return detail_words(self.detail, self.micro_batch)

    def as_dict(self) -> dict:
        stored = {
            "kind": self.kind.value,
            "value": self.value,
            "threshold": self.threshold,
            "micro_batch": self.micro_batch,
            "detail": self.detail,
            "local": self.local,
        }
        return stored if self.update_change is None else {**stored, "update_change": self.update_change}

    def __getitem__(self, key: str) -> Any:
        """The stored form's `key` (`dump.trigger["kind"]`), as when Dump.trigger was a dict. Deprecated."""
        warnings.warn(
            "Dump.trigger is a forensics.core.trigger.Trigger: read trigger.kind, trigger.value ... instead of "
            "trigger['kind']",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.as_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """The stored form's `key`, or `default` (dict-era spelling; deprecated like `trigger[key]`)."""
        warnings.warn(
            "Dump.trigger is a forensics.core.trigger.Trigger: read its attributes instead of trigger.get(key)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.as_dict().get(key, default)

    @classmethod
    def from_dict(cls, data: Mapping | None) -> "Trigger":
        """The stored form back (a missing kind reads as `nonfinite_loss`, a missing `local` as true). A dump's
        manifest is checked before this reads it (forensics/format/manifest.py); anything else a field holds that
        is not of its type reads as missing.

        Raises:
            ValueError: an unknown kind.
        """
        data = data if isinstance(data, Mapping) else {}
        index = data.get("micro_batch")
        return cls(
            TriggerKind.parse(data.get("kind") or TriggerKind.NONFINITE_LOSS),
            lenient_float(data.get("value")),
            lenient_float(data.get("threshold")),
            index if isinstance(index, int) and not isinstance(index, bool) else None,
            str(data.get("detail") or ""),
            data.get("local", True) is not False,
            lenient_float(data.get("update_change")),
        )


def detail_words(detail: Any, micro_batch: Any) -> str:
    """A detector's one-line detail in 1-based words.

    The Guard writes e.g. 'loss of micro-batch 1 is nan' with the 0-based index (the JSON's). When the number in
    the detail is the trigger's own 0-based `micro_batch`, it is shown 1-based; any other number (a detail already
    written 1-based) is left alone.
    """
    detail = str(detail or "")
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool):
        return detail
    return DETAIL_MICRO_BATCH.sub(
        lambda m: f"micro-batch {micro_batch + 1}" if int(m.group(1)) == micro_batch else m.group(0), detail
    )


def trigger_detail(trigger: Mapping | Trigger) -> str:
    """`detail_words` of a trigger: a Trigger, or a stored / report `trigger` block ({"detail", "micro_batch"})."""
    if isinstance(trigger, Trigger):
        return trigger.message
    return detail_words(trigger.get("detail"), trigger.get("micro_batch"))
