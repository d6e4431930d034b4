"""Precision triage: does the failure survive in fp32 (no autocast, no loss scaling, fp32 weights)?

If it vanishes, the failure is (at least partly) a precision problem: an fp16 overflow, bf16
rounding, a loss scale out of range. If it stays, suspect the data or the model state instead.

The fp32 pass is held to float32 whatever the user's code enters or casts to (replay/run/fp32.py), and what ran is
counted: the block's `fp32_ran` says it ("214 ops in float32, none in float16"), and when a compute op still ran
below float32, or none ran, `fp32_reproduces` stays None — no conclusion is drawn from a pass that did not run as
stated. A job whose dump records no low precision but whose code computes in float16 / bfloat16 anyway (autocast
inside the loss, `.half()` in the forward) is found out by counting one forward pass in its own precision.
"""

from __future__ import annotations

import logging
from typing import Any, TypedDict

import torch

from forensics.report.wording import fp32_ran_words
from forensics.core.kinds import TriggerKind
from forensics.replay.run.execute import SampleRef, StepRunner
from forensics.replay.run.fp32 import CountDtypes

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
    fp32_ran: dict[str, Any]
    """What the fp32 pass ran (forensics.replay.run.fp32.Fp32Count.as_dict): compute ops by dtype, casts and autocasts held."""
    code_dtypes: dict[str, int]
    """A job that recorded no low precision: the compute ops of one forward in its own precision, by dtype."""


def uses_low_precision(runner: StepRunner) -> bool:
    """True when the job ran anything below fp32: autocast, FSDP2 mixed precision, half weights, or a GradScaler."""
    session = runner.session
    return (
        session.autocast_dtype is not None
        or session.fsdp_dtype is not None
        or session.param_dtype in _LOW
        or session.scaler_enabled
    )


def fp32_check(
    runner: StepRunner,
    samples: list[SampleRef] | None = None,
    *,
    kind: TriggerKind | str | None = None,
    threshold: float | None = None,
) -> PrecisionBlock:
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
    block: PrecisionBlock = {
        "autocast_dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
        "fp32_reproduces": None,
        "param_dtype": str(session.param_dtype).removeprefix("torch."),
        "grad_scaler": session.scaler_enabled,
    }
    if session.fsdp_dtype is not None:
        block["fsdp_param_dtype"] = str(session.fsdp_dtype).removeprefix("torch.")
    if kind is TriggerKind.NONFINITE_PARAM:
        return block
    if not uses_low_precision(runner):
        if runner.session.stream is not None:  # one more streamed pass over the whole model: not for a guess
            return block
        seen = code_dtypes(runner, samples)  # one forward of a model that fits: what the code computes in
        if not any(dtype in ("float16", "bfloat16") for dtype in seen):
            return block
        block["code_dtypes"] = seen  # the user's code computes below fp32 where the dump says nothing of it
    result = runner.run(samples, fp32=True)
    count = runner.fp32_count
    block["fp32_ran"] = count.as_dict()
    if not count.verified:
        logger.warning(
            "the fp32 re-run did not run in float32 (%s): no conclusion drawn from it", fp32_ran_words(count.as_dict())
        )
        return block
    block["fp32_reproduces"] = result.trigger_reproduced(kind, threshold)
    logger.info(
        "fp32 re-run: %s %s (losses %s, grad norm %s; %s)",
        kind,
        "still fires" if block["fp32_reproduces"] else "vanishes",
        result.losses,
        result.grad_norm,
        fp32_ran_words(count.as_dict()),
    )
    return block


def code_dtypes(runner: StepRunner, samples: list[SampleRef] | None = None) -> dict[str, int]:
    """The compute ops of one forward of the step (or `samples`) in the job's own precision, by output dtype
    ('float16': 12): what the user's code computes in, whatever the dump recorded. Never raises."""
    counter = CountDtypes()
    if not runner.forward_measured(counter, samples, "the dtypes of the step's own forward"):
        return {}
    return dict(sorted(counter.ops.items()))


__all__ = ["PrecisionBlock", "code_dtypes", "fp32_check", "uses_low_precision"]
