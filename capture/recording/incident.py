"""The values that travel through the Guard's dump path: the step being recorded, what fired, and the Incident.

`StepRecord` is what the Guard keeps of the step in progress (references only). A detector turns the
step's numbers into a `Trigger` (forensics/core/trigger.py, the record replay reads back). An `Incident` is everything the dump path needs about one trigger —
the step number, its record, the losses and grad norm read on the host, the policy — so no stage reads
it back from the Guard's mutable fields (the sync-free mode judges a step one check later, and
verify_update one optimizer step later: each builds its Incident with the right step and state).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from forensics.format.batch_tree import tensor_leaves
from forensics.core.kinds import Policy
from forensics.core.rng import RngState
from forensics.core.trigger import Trigger

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What the Guard keeps of the step in progress: references only, nothing copied."""

    batches: list[Any] = field(default_factory=list)
    sample_ids: list[Any] = field(default_factory=list)
    rng: list[RngState] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    autocast: dict | None = None
    seen_ids: set = field(default_factory=set)
    """The step's sample IDs so far (hashable host values only), to warn of one that names two samples."""
    duplicate_id: bool = False
    """A sample ID of this step was seen twice (warned once per step)."""

    def divisor(self, loss_divisor: float | None) -> float:
        """What the step loss divides the summed micro-batch losses by (GuardConfig.detection.loss_divisor, else the
        number of micro-batch losses recorded)."""
        return float(loss_divisor or max(len(self.losses), 1))


@dataclass(frozen=True)
class Undumpable:
    """Why an incident cannot be dumped at all (sync-free check: a spike judged after its update was applied)."""

    why: str
    """The line the dump budget counts it under."""
    reason: str
    """Its key in the manifest's `dump_budget.not_dumped`."""
    error: str
    """What the TrainingFaultError says under 'raise'."""


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
    """Pre-step model / optimizer state already collected (verify_update); None: collect now."""
    scheduler: dict | None = None
    """Scheduler state saved at the step's check (sync-free: the scheduler has moved on since)."""
    hyper: list[dict] | None = None
    """The optimizer's param-group hyper-parameters (lr, betas, ...) saved at the step's check, by group (sync-free:
    the scheduler has changed them since); None: as they are at the dump."""
    exception: dict | None = None
    """The manifest's `exception` section when the step raised (capture/raised/exceptions.py)."""
    grad_norm_unscaled_by: float | None = None
    """The loss scale the Guard divided its own grad norm by (the manifest's `loss.grad_norm_unscaled_by`)."""
    agreed: bool = False
    """Every rank of a multi-rank job dumps this step (a trigger agreed at check()): the dump may exchange
    data between ranks (buddy copies) before writing."""
    accumulation: int | None = None
    """The step's micro-batch count when the record holds fewer (a step that raised part-way); None: the record's."""
    undumpable: Undumpable | None = None
    """Set when the incident cannot be dumped: the Guard still counts it and applies its policy."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Files the trigger adds to its dump (a silent corruption's `silent.json`)."""

    @property
    def step_loss(self) -> float | None:
        return sum(self.losses) / self.divisor if self.losses else None


def json_ids(ids: Any) -> list | None:
    """Sample IDs as JSON values: tensors become lists of numbers; an ID that is not a JSON value (an
    object, a tuple, a non-finite float) or that fails to convert is stored as its repr, with a warning,
    so that odd IDs never cost the dump."""
    if ids is None:
        return None
    try:
        if isinstance(ids, torch.Tensor):
            return ids.detach().cpu().reshape(-1).tolist()
        values = (
            list(ids) if isinstance(ids, (list, tuple)) else [ids] if isinstance(ids, (str, int, float)) else list(ids)
        )
        return [_json_id(i.item() if isinstance(i, torch.Tensor) and i.numel() == 1 else i) for i in values]
    except Exception as exc:  # noqa: BLE001 - an ID container whose iteration or conversion raises
        log.warning(
            "forensics: the sample IDs of a micro-batch could not be read (%s: %s); stored as one repr",
            type(exc).__name__,
            exc,
        )
        return [_short_repr(ids)]


def _json_id(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if abs(value) < 1 << 63 else str(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    log.warning("forensics: a sample ID of type %s is not a JSON value; stored as its repr", type(value).__name__)
    return _short_repr(value)


def _short_repr(value: Any) -> str:
    try:
        return repr(value)[:1000]
    except Exception:  # noqa: BLE001
        return f"<{type(value).__name__} without a repr>"


def leading_dim(batch: Any) -> int | None:
    """The leading dimension of the first tensor in a batch tree, or None (no tensor with one, or a batch that
    cannot be walked): the manifest's `batch_size`. Replay infers a batch's size by its own rule
    (replay/load/samples.batch_size)."""
    try:
        return next((t.shape[0] for _, t in tensor_leaves(batch) if t.dim()), None)
    except Exception:  # noqa: BLE001 - an odd batch must not cost the dump
        return None
