"""The values that travel through the Guard's dump path: the step being recorded, what fired, and the Incident.

`StepRecord` is what the Guard keeps of the step in progress (references only). A detector turns the
step's numbers into a `Trigger`. An `Incident` is everything the dump path needs about one trigger —
the step number, its record, the losses and grad norm read on the host, the policy — so no stage reads
it back from the Guard's mutable fields (the sync-free mode judges a step one check later, and
verify_update one optimizer step later: each builds its Incident with the right step and state).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from forensics.kinds import Policy, TriggerKind
from forensics.rng import RngState


@dataclass
class StepRecord:
    """What the Guard keeps of the step in progress: references only, nothing copied."""

    batches: list[Any] = field(default_factory=list)
    sample_ids: list[Any] = field(default_factory=list)
    rng: list[RngState] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    autocast: dict | None = None

    def divisor(self, loss_divisor: float | None) -> float:
        """What the step loss divides the summed micro-batch losses by (GuardConfig.loss_divisor, else the
        number of micro-batch losses recorded)."""
        return float(loss_divisor or max(len(self.losses), 1))


@dataclass
class Trigger:
    """What fired: written as the manifest's `trigger` section (docs/DUMP_FORMAT.md)."""

    kind: TriggerKind
    value: float
    threshold: float | None
    micro_batch: int | None
    detail: str
    local: bool = True
    """False when this rank only inherited the trigger from another rank."""

    def as_dict(self) -> dict:
        return {"kind": self.kind.value, "value": self.value, "threshold": self.threshold,
                "micro_batch": self.micro_batch, "detail": self.detail, "local": self.local}


@dataclass
class Incident:
    """One trigger at one step, with everything the dump and the policy need."""

    trigger: Trigger
    step: int
    record: StepRecord
    losses: list[float]
    """Per-micro-batch losses as host numbers."""
    grad_norm: float | None
    divisor: float
    policy: Policy
    state: dict | None = None
    """Pre-step model / optimizer state already collected (sync-free, verify_update); None: collect now."""
    scheduler: dict | None = None
    """Scheduler state saved at the step's check (sync-free: the scheduler has moved on since)."""

    @property
    def step_loss(self) -> float | None:
        return sum(self.losses) / self.divisor if self.losses else None


def json_ids(ids: Any) -> list | None:
    """Sample IDs as JSON values (tensors become lists of numbers)."""
    if ids is None:
        return None
    if isinstance(ids, torch.Tensor):
        return ids.detach().cpu().reshape(-1).tolist()
    return [i.item() if isinstance(i, torch.Tensor) else i for i in ids]


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the first tensor in a batch tree (None: no tensor with one)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        size = batch_size(value)
        if size is not None:
            return size
    return None
