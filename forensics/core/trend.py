"""Robust growth detection on one statistic's series (the precursor monitor in the job, its ranking in replay).

A value is 'above' its baseline when its log exceeds the running median of the recent healthy log-values by more
than `z_threshold` robust standard deviations (1.4826 x MAD) AND by at least log(min_growth); it fires once
`sustained` consecutive values are above. Values of an excursion never enter the baseline, so a slow rise cannot
drag the baseline along with it. For a statistic whose fall announces trouble (Adam's second-moment floor) the
log is negated.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
TINY = 1e-38  # a value of 0 (an Adam floor) is taken as this: log(0) would be -inf


@dataclass(frozen=True)
class Excursion:
    """A sustained departure from the baseline."""

    started: int
    """The step of its first value."""
    value: float
    """The value at the step it was confirmed."""
    baseline: float
    """The median of the healthy values before it."""
    z: float


class RobustTrend:
    """One statistic's baseline (running median / MAD of its healthy log-values) and its excursion in progress."""

    def __init__(
        self, window: int, warmup: int, sustained: int, z_threshold: float, min_growth: float, rising: bool = True
    ):
        self.window, self.warmup, self.sustained, self.seen = window, warmup, sustained, 0
        self.z_threshold, self.min_log_growth = z_threshold, math.log(min_growth)
        self.sign = 1.0 if rising else -1.0
        self.base: deque[float] = deque(maxlen=window)
        self.run: list[tuple[int, float, float]] = []  # (step, value, z) of the excursion in progress

    def observe(self, step: int, value: float | None) -> Excursion | None:
        """The excursion, once it has lasted `sustained` values (then the baseline starts afresh), else None.
        None, negative and non-finite values are ignored."""
        if value is None or not math.isfinite(value) or value < 0:
            return None
        x = self.sign * math.log(max(value, TINY))
        self.seen += 1
        if self.seen <= self.warmup or len(self.base) < min(4, self.window):
            self.base.append(x)  # the window keeps the newest healthy values: warm-up may be longer than it
            return None
        median = statistics.median(self.base)
        mad = statistics.median(abs(v - median) for v in self.base)
        z = (x - median) / (MAD_TO_SIGMA * mad) if mad > 0 else math.inf if x > median else 0.0
        if z < self.z_threshold or x - median < self.min_log_growth:
            self.run.clear()
            self.base.append(x)
            return None
        self.run.append((step, value, z))
        if len(self.run) < self.sustained:
            return None
        found = Excursion(self.run[0][0], value, math.exp(self.sign * median), z)
        self.run.clear()
        self.base.clear()  # adapt to the new level: the statistic fires again only once the window is refilled
        self.seen = self.warmup - self.window
        return found
