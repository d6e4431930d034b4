"""DistributedGuard: the Guard plus what framework adapters (Accelerate, DeepSpeed, Trainer, Lightning) add to it.

The multi-rank behaviour itself (one all-reduce per step so every rank triggers on the same step,
spikes included; the dump cap counting attempts; SIGTERM held while a rank writes; DDP / compile
wrappers stripped) is the plain Guard's (capture/guard.py, capture/detection/agreement.py): a plain `Guard`
under torchrun is just as correct. What this class adds is framework-specific: the autocast a
framework applies where the loop cannot see it, and `integration` info in the manifest's `distributed`
section (the state source's `integration`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from forensics.capture.detection.agreement import Agreement
from forensics.capture.state.unwrap import unwrap_model
from forensics.capture.dumping.signals import deferred_termination
from forensics.capture.config import GuardConfig
from forensics.capture.guard import Guard
from forensics.capture.state.source import StateSource, state_source

__all__ = ["Agreement", "DistributedGuard", "deferred_termination", "unwrap_model"]

log = logging.getLogger(__name__)


class DistributedGuard(Guard):
    """Guard for framework adapters; in a plain torch DDP loop it behaves exactly like Guard.

    Adds to Guard: `autocast` (the framework's autocast, recorded when the model's own forward does
    not show it) and `integration` (framework, ZeRO stage, ...: written to the manifest's
    `distributed` section).

    Args:
        model, optimizer, scheduler, scaler, config, loss_fn: as for Guard.
        autocast: `{"enabled", "device_type", "dtype"}` the framework applies inside the forward.
    Example:
        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)           # doctest: +SKIP
        >>> guard = DistributedGuard(ddp, optimizer, scheduler, config=GuardConfig(dump_dir="dumps"))  # doctest: +SKIP
        >>> # then the Guard loop: record_batch, record_loss, check(grad_norm=clip_grad_norm_(...))
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        config: GuardConfig | None = None,
        loss_fn: Callable | None = None,
        autocast: dict | None = None,
        state: Callable[..., StateSource] = state_source,
    ):
        super().__init__(model, optimizer, scheduler, scaler, config=config, loss_fn=loss_fn, state=state)
        self.autocast = autocast
        """The autocast a framework applies inside the model's forward (where the loop cannot see it)."""
        if self.state.integration is None:
            self.integration = {"framework": "torch"}

    @property
    def integration(self) -> dict | None:
        """Written to the manifest's `distributed` section: framework, ZeRO stage, how state was gathered (the state
        source's `integration`)."""
        return self.state.integration

    @integration.setter
    def integration(self, value: dict) -> None:
        self.state.integration = value

    def record_loss(self, loss: Any) -> None:
        super().record_loss(loss)
        record = self.recorder.current
        if self.autocast and record is not None and not (record.autocast or {}).get("enabled"):
            record.autocast = dict(self.autocast)
