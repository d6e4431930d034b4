"""How close a statistic measured in a low-precision dtype is to that dtype's hard limit, and when it gets there.

The relative rule of forensics/core/trend.py sees a statistic that grows fast against its recent past; a slow, steady
climb toward a dtype's limit (the attention-logit bound of a block rising 2.6x over 80 steps in fp16 autocast, each
sample under 2x its 32-step median) passes it. Two more rules judge the statistics whose overflow breaks the step
(block output abs-max, attention-logit bound, output-logit abs-max), from the dtype they were measured in:

* headroom: the value passes HEADROOM (half) of the dtype's limit for that statistic — and at once when it is
  non-finite on a step whose loss was finite (the forward overflowed and something downstream hid it);
* trend: a robust log-linear slope (Theil–Sen: the median of the pairwise slopes of log(value) against the step)
  over the last TREND_SAMPLES sampled values forecasts the limit within HORIZON steps, the growth being steady
  (at least STEADY of the pairwise slopes positive) and the value already at least FLOOR of the limit.

The limits (`limit_of`):

* fp16 (max finite 65,504): block output and output-logit abs-max at 65,504. The attention-logit bound
  max|q|·|k|/√d at 65,504/√d: an eager attention (GPT-2's, a hand-written q @ k.T / √d) forms q·k in fp16 *before*
  scaling it, so that product overflows first. Fused kernels (SDPA, flash) scale first or accumulate in fp32: with
  them the warning comes √d earlier than the overflow, for a bound (hundreds to thousands) no healthy run reaches.
* bf16 keeps fp32's exponent (max 3.4e38): no activation of a sane run overflows it, so block outputs have no
  limit. What breaks logits that feed exp (attention softmax, the output softmax) is resolution: bf16 has 8
  significant bits, so from |x| >= 256 neighbouring values are 2 apart, and a logit rounded by 1 moves its softmax
  weight by e (2.7x): BF16_LOGIT_LIMIT = 256 for the attention-logit bound (already divided by √d: the rounding of
  the scaled logit is what softmax sees) and the output logits. Kimi K2 clips attention logits at 100 for the same
  reason (QK-Clip); half of 256 is 128.
* fp32 and wider: none (the relative rule alone).

The constants are chosen so that a healthy run never fires: half the limit of fp16 is 32,752 for an activation and
1,024-2,048 for an attention bound (d = 64-256); the trend's FLOOR (1/16 of the limit) keeps the fast, decelerating
growth of early training (attention logits growing tens of times from a random init, at values far below the limit)
out of the forecast. tests/capture/test_headroom.py and tests/natural/ hold them to that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from forensics.core.kinds import PrecursorRule, PrecursorStatistic

FP16_MAX = 65504.0
BF16_LOGIT_LIMIT = 256.0
HEADROOM = 0.5  # fraction of the limit that fires at once
TREND_SAMPLES = 16  # sampled values the slope is taken over (128 steps at PrecursorConfig.every = 8)
MIN_TREND_SAMPLES = 6  # fewer: no forecast (48 steps at every = 8)
HORIZON = 200  # steps: a forecast that reaches the limit within this many steps fires
STEADY = 0.75  # share of pairwise slopes that must be positive: a noisy series forecasts nothing
FLOOR = 1 / 16  # the value must be at least this fraction of the limit before a forecast may fire

LIMITED = (PrecursorStatistic.BLOCK_ABSMAX, PrecursorStatistic.ATTENTION_LOGIT, PrecursorStatistic.OUTPUT_LOGIT)
"""The statistics whose overflow breaks the forward (block RMS follows abs-max; the gradient and optimizer statistics
are of fp32 parameters and states)."""
_LOGITS = (PrecursorStatistic.ATTENTION_LOGIT, PrecursorStatistic.OUTPUT_LOGIT)
_NAMES = {"float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Limit:
    """A statistic's hard limit in the dtype it was measured in."""

    value: float
    words: str
    """'fp16's max (65,504)', 'fp16's max for q·k (65,504/√16)', 'bf16's logit resolution limit (256)'."""


def known_dtype_name(dtype: object) -> str | None:
    """'float16' for torch.float16 (or the string 'float16'); None for anything else unknown."""
    name = str(dtype).removeprefix("torch.")
    return name if name.replace("_", "").isalnum() and len(name) <= 32 else None


def limit_of(statistic: PrecursorStatistic, dtype: str | None, head_dim: int | None = None) -> Limit | None:
    """The limit of `statistic` measured in `dtype` (a torch dtype's name), or None: no limit applies."""
    if statistic not in LIMITED or dtype not in _NAMES:
        return None
    if dtype == "float16":
        if statistic is PrecursorStatistic.ATTENTION_LOGIT:
            if not head_dim or head_dim < 1:
                return None
            return Limit(FP16_MAX / math.sqrt(head_dim), f"fp16's max for q·k before scaling (65,504/√{head_dim})")
        return Limit(FP16_MAX, "fp16's max (65,504)")
    if statistic in _LOGITS:
        return Limit(BF16_LOGIT_LIMIT, "bf16's resolution limit for logits (256: one rounding step = 2)")
    return None


def theil_sen(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(median pairwise slope, share of positive pairwise slopes) of (x, y) points; None under 2 distinct x."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1]
    if not slopes:
        return None
    slopes.sort()
    mid = len(slopes) // 2
    median = slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2
    return median, sum(s > 0 for s in slopes) / len(slopes)


def forecast(points: list[tuple[int, float]], limit: float) -> float | None:
    """Steps until the log-linear trend of (step, value) `points` reaches `limit` from the last value: None when
    there are too few points, the growth is not steady or not positive."""
    usable = [(s, math.log(v)) for s, v in points[-TREND_SAMPLES:] if v is not None and v > 0 and math.isfinite(v)]
    if len(usable) < MIN_TREND_SAMPLES:
        return None
    fit = theil_sen(usable)
    if fit is None or fit[0] <= 0 or fit[1] < STEADY:
        return None
    return max(0.0, (math.log(limit) - usable[-1][1]) / fit[0])


@dataclass(frozen=True)
class Alarm:
    """What the headroom or trend rule saw at one sampled step."""

    rule: PrecursorRule
    value: float
    limit: Limit
    steps_left: float | None = None
    """The trend's forecast: steps until the limit."""
    growth: float | None = None
    """The trend's window: last / first value, and over how many steps (`span`)."""
    span: int | None = None


class LimitWatch:
    """One statistic's headroom and trend against its dtype's limit, sampled step by sampled step."""

    def __init__(self, limit: Limit, warmup: int = 0):
        self.limit, self.warmup = limit, warmup
        """Steps before which no value enters the trend (early training's fast, decelerating growth)."""
        self.points: list[tuple[int, float]] = []

    def observe(self, step: int, value: float | None, healthy: bool = True) -> Alarm | None:
        """The alarm at this sampled step, if any. `value` None or non-finite on a `healthy` step (its loss was
        finite): the forward overflowed — an alarm at once. Never raises."""
        if value is None or not math.isfinite(value):
            return Alarm(PrecursorRule.NONFINITE, math.inf, self.limit) if healthy and value is not None else None
        if value <= 0:
            return None
        if step >= self.warmup:
            self.points.append((step, value))
        del self.points[:-TREND_SAMPLES]
        if value >= HEADROOM * self.limit.value:
            return Alarm(PrecursorRule.HEADROOM, value, self.limit)
        if value < FLOOR * self.limit.value:
            return None
        left = forecast(self.points, self.limit.value)
        if left is None or left > HORIZON:
            return None
        first = self.points[0]
        return Alarm(PrecursorRule.TREND, value, self.limit, left, value / first[1], step - first[0])


def percent_of(value: float, limit: float) -> str:
    """'79 %' of value / limit (rounded; '>999 %' beyond)."""
    share = 100 * value / limit
    return f"{share:.0f} %" if share < 999.5 else ">999 %"


def describe_alarm(alarm: Alarm, what: str) -> str:
    """One plain sentence for an alarm of `what` ('the attention-logit bound of `transformer.h.0`')."""
    if alarm.rule is PrecursorRule.NONFINITE:
        return (
            f"{what} overflowed ({alarm.limit.words}) on a step whose loss was still finite: the forward "
            "already makes Inf/NaN somewhere that a later op hides"
        )
    share = percent_of(alarm.value, alarm.limit.value)
    if alarm.rule is PrecursorRule.HEADROOM:
        return f"{what} reached {alarm.value:.4g}, {share} of {alarm.limit.words}"
    return (
        f"{what} grew {alarm.growth:.2g}x over the last {alarm.span} steps to {alarm.value:.4g} ({share} of "
        f"{alarm.limit.words}); at that rate it reaches the limit in ~{alarm.steps_left:.0f} steps"
    )
