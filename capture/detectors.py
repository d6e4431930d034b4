"""NaN-safe robust spike detection (rolling median / MAD with warm-up) on per-step scalars."""

from __future__ import annotations

import math
import statistics
from collections import deque

from capture.config import SpikeConfig

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


class SpikeDetector:
    """Flags values far above the recent median; only finite values enter the window."""

    def __init__(self, config: SpikeConfig):
        self.config = config
        self._window: deque[float] = deque(maxlen=config.window)

    def threshold(self) -> float | None:
        """The value above which the next observation is a spike, or None during warm-up."""
        if not self.config.enabled or len(self._window) < self.config.warmup:
            return None
        values = list(self._window)
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        robust = median + self.config.mad_factor * MAD_TO_SIGMA * mad
        return max(robust, median * self.config.min_ratio) if median > 0 else robust

    def observe(self, value: float | None) -> float | None:
        """Returns the threshold `value` exceeded (a spike), else None; then adds `value` to the window."""
        if value is None or not math.isfinite(value):
            return None
        limit = self.threshold()
        self._window.append(value)
        return limit if limit is not None and value > limit else None
