"""Precision triage: does the failure survive in fp32 (no autocast, no loss scaling, fp32 weights)?

If it vanishes, the failure is (at least partly) a precision problem: an fp16 overflow, bf16
rounding, a loss scale out of range. If it stays, suspect the data or the model state instead.
"""

from __future__ import annotations

import logging
from typing import TypedDict

import torch

from forensics.kinds import TriggerKind
from replay.run.execute import SampleRef, StepRunner

logger = logging.getLogger(__name__)

_LOW = (torch.float16, torch.bfloat16)


class _PrecisionFacts(TypedDict):
    autocast_dtype: str | None
    fp32_reproduces: bool | None
    param_dtype: str
    grad_scaler: bool


class PrecisionBlock(_PrecisionFacts, total=False):
    """The report's `precision` block (docs/REPORT_FORMAT.md); `fsdp_param_dtype` only for FSDP2 mixed precision."""

    fsdp_param_dtype: str


def uses_low_precision(runner: StepRunner) -> bool:
    """True when the job ran anything below fp32: autocast, FSDP2 mixed precision, half weights, or a GradScaler."""
    session = runner.session
    return session.autocast_dtype is not None or session.fsdp_dtype is not None or session.param_dtype in _LOW \
        or session.scaler_enabled


def fp32_check(runner: StepRunner, samples: list[SampleRef] | None = None, *, kind: TriggerKind | str | None = None,
               threshold: float | None = None) -> PrecisionBlock:
    """Re-runs the step (or `samples`) in fp32 and says whether the trigger still fires.

    Args:
        runner: the step runner.
        samples: e.g. the culprit samples from bisection (None: the whole step).
        kind / threshold: the trigger to test (default: the session's trigger).
    Returns:
        The report's "precision" block: {"autocast_dtype": "bfloat16"|None, "fp32_reproduces": bool|None,
        "param_dtype": str, "grad_scaler": bool}. fp32_reproduces is None when the job already ran in
        fp32 (nothing to compare) or for a nonfinite_param trigger (weights do not depend on precision).
    Example:
        >>> fp32_check(runner, culprits)["fp32_reproduces"]  # doctest: +SKIP
        False
    """
    session = runner.session
    trigger = session.trigger
    kind = TriggerKind.parse(kind) if kind else trigger.kind
    if threshold is None and trigger.threshold is not None:
        threshold = trigger.threshold
    dtype = session.autocast_dtype
    block: PrecisionBlock = {"autocast_dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
             "fp32_reproduces": None,
             "param_dtype": str(session.param_dtype).removeprefix("torch."),
             "grad_scaler": session.scaler_enabled}
    if session.fsdp_dtype is not None:
        block["fsdp_param_dtype"] = str(session.fsdp_dtype).removeprefix("torch.")
    if kind is TriggerKind.NONFINITE_PARAM or not uses_low_precision(runner):
        return block
    result = runner.run(samples, fp32=True)
    block["fp32_reproduces"] = result.trigger_reproduced(kind, threshold)
    logger.info("fp32 re-run: %s %s (losses %s, grad norm %s)", kind,
                "still fires" if block["fp32_reproduces"] else "vanishes", result.losses, result.grad_norm)
    return block


__all__ = ["PrecisionBlock", "fp32_check", "uses_low_precision"]
