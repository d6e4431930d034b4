"""GuardConfig.verify_update: the state is copied before each optimizer step, and an update that makes a finite
parameter non-finite is dumped as a `nonfinite_param` incident with that copy as its pre-step state."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from capture.config import GuardConfig
from capture.record.history import History
from capture.record.incident import Incident, StepRecord
from capture.state import snapshot
from forensics.kinds import TriggerKind
from forensics.trigger import Trigger

log = logging.getLogger(__name__)


class UpdateSource(Protocol):
    """What the update check reads of the Guard and calls back."""

    model: torch.nn.Module
    optimizer: Any
    config: GuardConfig
    history: History
    step: int
    last_step: StepRecord | None

    def collect_state(self, copy: snapshot.HostCopy) -> dict: ...

    def handle_incident(self, incident: Incident) -> bool: ...

    def add_hook(self, handle: Any) -> None: ...


class UpdateCheck:
    """Optimizer step pre/post hooks (installed by the Guard, removed by Guard.close())."""

    def __init__(self, guard: UpdateSource):
        self.guard = guard
        self._pre_step_copy: dict | None = None
        self._warned_already_bad = False
        guard.add_hook(guard.optimizer.register_step_pre_hook(self.before))
        guard.add_hook(guard.optimizer.register_step_post_hook(self.after))

    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook: a host copy of the state the update starts from."""
        try:
            copy = snapshot.HostCopy(enabled=True)
            self._pre_step_copy = self.guard.collect_state(copy)
            copy.finish()
            copy.wait()
        except Exception:
            log.exception("forensics: verify_update could not copy the pre-step state")
            self._pre_step_copy = None

    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step post-hook: dumps the step when its update made a finite parameter non-finite."""
        g = self.guard
        state, self._pre_step_copy = self._pre_step_copy, None
        if state is None:
            return
        params = [p for p in g.model.parameters()]
        if not params or _all_finite(params):
            return
        step = g.step - 1  # check() already advanced the counter
        before = state.get("model") or {}
        broken = [name for name, p in g.model.named_parameters() if not bool(torch.isfinite(p).all())]
        newly = [name for name in broken
                 if name not in before or bool(torch.isfinite(before[name]).all())]  # finite before this update
        if not newly:
            if not self._warned_already_bad:
                self._warned_already_bad = True
                log.warning("forensics: verify_update: %s was already non-finite before the update of step %d, so that "
                            "update is not blamed (an earlier step, or the data loaded into the model, broke it)",
                            broken[0], step)
            return
        bad = newly[0]
        record = g.last_step or StepRecord()
        trigger = Trigger(TriggerKind.NONFINITE_PARAM, float("nan"), None, None,
                          f"the optimizer update of step {step} made parameter {bad} non-finite")
        norm = g.history.to_dict()["grad_norm"][-1] if len(g.history) else float("nan")
        g.handle_incident(Incident(trigger, step, record, [float(v) for v in record.losses], norm,
                                   record.divisor(g.config.loss_divisor),
                                   g.config.policy_for(trigger.kind), state=state))


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Every tensor finite: one device->host read per device the tensors live on (a model split over several GPUs
    cannot stack its flags on one device)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
    return all(bool(torch.stack(flags).all()) for flags in by_device.values())
