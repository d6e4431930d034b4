"""GuardConfig.detection.verify_update: the state is copied before each optimizer step, and an update that makes a
finite parameter non-finite is dumped as a `nonfinite_param` incident with that copy as its pre-step state."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable

import torch

from forensics.capture.config import DetectionConfig
from forensics.capture.recording.history import History
from forensics.capture.recording.incident import Incident, StepRecord
from forensics.capture.state import snapshot
from forensics.capture.state.source import StateSource
from forensics.core.kinds import TriggerKind
from forensics.core.trigger import Trigger

log = logging.getLogger(__name__)


class UpdateCheck:
    """Optimizer step pre/post hooks (kept through `add_hook`: the Guard removes them at close()).

    Args:
        detection: GuardConfig.detection (loss_divisor, the policy); state: the state source (model, optimizer, the pre-step state).
        history: the grad norm of the step checked last.
        last_checked: the step number and record of the step check() saw last.
        report: the Guard's handle_incident: dumps the Incident this check builds and applies its policy.
        add_hook: keeps a removable hook handle.
    """

    def __init__(
        self,
        detection: DetectionConfig,
        state: StateSource,
        history: History,
        last_checked: Callable[[], tuple[int, StepRecord | None]],
        report: Callable[[Incident], Any],
        add_hook: Callable[[Any], None],
    ):
        self.detection, self.state, self.history = detection, state, history
        self.last_checked, self.report = last_checked, report
        self._pre_step_copy: dict | None = None
        self._warned_already_bad = False
        add_hook(state.optimizer.register_step_pre_hook(self.before))
        add_hook(state.optimizer.register_step_post_hook(self.after))

    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook: a host copy of the state the update starts from."""
        try:
            copy = snapshot.HostCopy(enabled=True)
            self._pre_step_copy = self.state.collect(copy)
            copy.finish()
            copy.wait()
        except Exception:
            log.exception("forensics: verify_update could not copy the pre-step state")
            self._pre_step_copy = None

    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step post-hook: dumps the step when its update made a finite parameter non-finite."""
        model = self.state.model
        state, self._pre_step_copy = self._pre_step_copy, None
        if state is None:
            return
        params = [p for p in model.parameters()]
        if not params or _all_finite(params):
            return
        step, last = self.last_checked()
        before = state.get("model") or {}
        broken = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
        newly = [
            name for name in broken if name not in before or bool(torch.isfinite(before[name]).all())
        ]  # finite before this update
        if not newly:
            if not self._warned_already_bad:
                self._warned_already_bad = True
                log.warning(
                    "forensics: verify_update: %s was already non-finite before the update of step %d, so that "
                    "update is not blamed (an earlier step, or the data loaded into the model, broke it)",
                    broken[0],
                    step,
                )
            return
        bad = newly[0]
        record = last or StepRecord()
        trigger = Trigger(
            TriggerKind.NONFINITE_PARAM,
            float("nan"),
            None,
            None,
            f"the optimizer update of step {step} made parameter {bad} non-finite",
        )
        norm = self.history.to_dict()["grad_norm"][-1] if len(self.history) else float("nan")
        self.report(
            Incident(
                trigger,
                step,
                record,
                [float(v) for v in record.losses],
                norm,
                record.divisor(self.detection.loss_divisor),
                self.detection.policy_for(trigger.kind),
                state=state,
            )
        )


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Every tensor finite: one device->host read per device the tensors live on (a model split over several GPUs
    cannot stack its flags on one device)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
    return all(bool(torch.stack(flags).all()) for flags in by_device.values())
