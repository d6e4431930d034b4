"""Is the fp16 overflow the sample's doing, or is every sample at the edge? The margin the rest of the step keeps.

Bisection names the smallest set of samples that makes the step fail; in a run whose state has grown to the edge of
fp16 (attention or output logits climbing for hundreds of steps), that is whichever sample crossed the limit first —
the next step, another one would. Blaming it sends the user to filter a harmless sample. So when the step fails only
in fp16 with some samples, the step is run again, forward only and in its recorded precision, *without* them, and
the largest finite value any fp16 op produces is measured (a dispatch mode: every op, not only module outputs,
since the overflow is usually inside one — q @ k.T in an attention). When the others reach forensics.core.headroom.HEADROOM
(half) of fp16's largest value too, the samples are not culprits: the state is (report `margin`).
"""

from __future__ import annotations

import logging
import math
from typing import TypedDict

import torch

from forensics.core.headroom import FP16_MAX, HEADROOM
from forensics.core.thirdparty import TorchDispatchMode, tree_leaves
from forensics.replay.run.execute import SampleRef, StepRunner

logger = logging.getLogger(__name__)


class MarginBlock(TypedDict):
    """The report's `margin` block (docs/REPORT_FORMAT.md)."""

    dtype: str
    others_absmax: float
    """The largest finite |value| of any fp16 op, over the step without the samples bisection named."""
    limit: float
    share: float
    """others_absmax / limit."""
    samples_excluded: int
    at_the_edge: bool
    """share >= HEADROOM: the state, not the samples, brings the step to the overflow."""


_UNWRITTEN = {
    getattr(torch.ops.aten, name)
    for name in ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted", "resize_")
    if hasattr(torch.ops.aten, name)
}
"""Ops whose output holds no computed value (allocations): measuring them read stale memory (a flaky verdict)."""


class _LargestHalf(TorchDispatchMode):
    """Keeps the largest finite |value| among the fp16 outputs of every op run under it (a 0-dim tensor)."""

    def __init__(self):
        super().__init__()
        self.largest: torch.Tensor | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _UNWRITTEN:  # uninitialised memory: whatever an earlier tensor left there
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float16 and t.numel():
                a = t.detach().abs()
                # fp16's largest value itself is a sentinel, not a computed value: attention masks are filled with
                # torch.finfo(float16).min (-65504), which would put every masked step 'at the edge'
                top = torch.where(a < FP16_MAX, a, torch.zeros_like(a)).amax().float()
                self.largest = top if self.largest is None else torch.maximum(self.largest, top)
        return out


FAR_FROM_LIMIT = 1e-3
"""The rest of a step is 'far from the limit' of its dtypes when no op's largest finite |value| reaches this share of
its dtype's largest value: then a sample that alone makes the loss non-finite does it by its own record (a log(0), a
division by zero), not by crossing an edge everyone is near (replay/culprits/evidence.py)."""


class _LargestShare(TorchDispatchMode):
    """Keeps, over every floating-point op output, the largest finite |value| as a share of its dtype's largest value
    (the dtype's own max, a sentinel that attention masks fill with, is left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.share = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _UNWRITTEN:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                limit = torch.finfo(t.dtype).max
                a = t.detach().abs()
                top = float(torch.where(torch.isfinite(a) & (a < limit), a, torch.zeros_like(a)).amax())
                self.share = max(self.share, top / limit)
        return out


def others_share(runner: StepRunner, culprits: list[SampleRef]) -> float | None:
    """How close the step's other samples come to their dtypes' largest values (0..1), forward only, without
    `culprits`; None when nothing is left to run or the run failed. Never raises."""
    rest = [r for r in runner.session.sample_refs if r not in set(culprits)]
    if not rest:
        return None
    mode = _LargestShare()
    if not runner.forward_measured(mode, rest, "how close the other samples come to the limit"):
        return None
    return mode.share


def others_margin(runner: StepRunner, culprits: list[SampleRef]) -> MarginBlock | None:
    """How close the step comes to fp16's limit without `culprits` (None: not an fp16-autocast step, nothing left
    to run, or the run failed). Never raises."""
    session = runner.session
    if session.autocast_dtype != torch.float16 or not culprits:
        return None
    rest = [r for r in session.sample_refs if r not in set(culprits)]
    if not rest:
        return None
    mode = _LargestHalf()
    if not runner.forward_measured(mode, rest, "the margin of the other samples"):
        return None
    if mode.largest is None:
        return None
    largest = float(mode.largest)
    if not math.isfinite(largest):
        return None
    share = largest / FP16_MAX
    return {
        "dtype": "float16",
        "others_absmax": largest,
        "limit": FP16_MAX,
        "share": share,
        "samples_excluded": len(culprits),
        "at_the_edge": share >= HEADROOM,
    }


__all__ = ["FAR_FROM_LIMIT", "MarginBlock", "others_margin", "others_share"]
