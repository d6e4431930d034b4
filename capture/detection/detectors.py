"""The Guard's detectors: NaN-safe robust spike detection (rolling median / MAD with warm-up) on per-step
scalars, and StepDetectors, which turns one step's numbers into a Trigger."""

from __future__ import annotations

import logging
import bisect
import math
from collections import deque

from forensics.capture.detection.agreement import Agreement
from forensics.capture.config import GuardConfig, SpikeConfig
from forensics.core.kinds import TriggerKind
from forensics.core.trigger import Trigger

log = logging.getLogger(__name__)

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


EARLY_EVIDENCE = 4  # finite values before the robust threshold can judge a value during warm-up
EARLY_RATIO = 10.0  # with fewer values, a value this many times the largest one so far is noted
MIN_WARMUP = 4  # the smallest SpikeConfig.warmup (capture/config.py checks it)


class SpikeDetector:
    """Flags values far above the recent median; only finite values enter the window.

    During warm-up (fewer than SpikeConfig.warmup finite values) nothing fires, but a value that the
    threshold over the values seen so far would flag (or, before EARLY_EVIDENCE values, one EARLY_RATIO
    times the largest so far) is reported in `suppressed`, so the Guard can say so instead of staying silent.

    Cost per observation (a healthy step's hot path): the window is also kept sorted (one bisect to add a value,
    one to drop the oldest), so the median is read, not computed; the MAD is taken only for a value above the
    lowest threshold the median allows (the median itself, times min_ratio when it is positive), i.e. almost
    never on a healthy run, by one walk outward from the median. The threshold is the one of the whole window,
    the same numbers as `statistics.median` over it.
    """

    def __init__(self, config: SpikeConfig):
        self.config = config
        self._window: deque[float] = deque(maxlen=config.window)
        self._sorted: list[float] = []
        """The values of `_window`, sorted."""
        self.suppressed: float | None = None
        """After observe(): the threshold a warm-up value exceeded (it was not flagged), else None."""

    def _median(self) -> float:
        values, n = self._sorted, len(self._sorted)
        return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2

    def _threshold(self) -> float:
        median = self._median()
        robust = median + self.config.mad_factor * MAD_TO_SIGMA * median_deviation(self._sorted, median)
        return max(robust, median * self.config.min_ratio) if median > 0 else robust

    def _below_any_threshold(self, value: float) -> bool:
        """True when `value` is at most the median (times min_ratio when the median is positive): no threshold
        the window can give is lower (the MAD is >= 0, min_ratio >= 1), so the MAD need not be taken."""
        median = self._median()
        return value <= (median * self.config.min_ratio if median > 0 else median)

    def threshold(self) -> float | None:
        """The value above which the next observation is a spike, or None during warm-up."""
        if not self.config.enabled or len(self._window) < self.config.warmup:
            return None
        return self._threshold()

    @property
    def warming_up(self) -> bool:
        """Fewer finite values seen than SpikeConfig.warmup: nothing fires yet (the warm-up advice reads it)."""
        return len(self._window) < self.config.warmup

    def observe(self, value: float | None) -> float | None:
        """Returns the threshold `value` exceeded (a spike), else None; then adds `value` to the window."""
        self.suppressed = None
        if value is None or not math.isfinite(value):
            return None
        limit = None
        if self.config.enabled and self._window:
            if len(self._window) >= self.config.warmup:
                limit = None if self._below_any_threshold(value) else self._threshold()
            elif len(self._window) < EARLY_EVIDENCE:
                largest = self._sorted[-1]
                early = EARLY_RATIO * largest if largest > 0 else None
                self.suppressed = early if early is not None and value > early else None
            elif not self._below_any_threshold(value):
                early = self._threshold()
                self.suppressed = early if value > early else None
        self._add(value)
        return limit if limit is not None and value > limit else None

    def _add(self, value: float) -> None:
        if len(self._window) == self._window.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._window[0])]
        self._window.append(value)
        bisect.insort(self._sorted, value)


def median_deviation(values: list[float], median: float) -> float:
    """The median of |v - median| over `values` (sorted), as `statistics.median` computes it: the deviations
    below and above the median are each sorted already, so the middle ones are found by walking outward from
    the median, smallest deviation first."""
    n = len(values)
    below = bisect.bisect_right(values, median) - 1  # the largest value <= median
    above = below + 1
    wanted = (n - 1) // 2, n // 2  # the positions of the middle deviation(s) in sorted order
    found = []
    for position in range(wanted[1] + 1):
        low = median - values[below] if below >= 0 else math.inf
        high = values[above] - median if above < n else math.inf
        if low <= high:
            deviation, below = low, below - 1
        else:
            deviation, above = high, above + 1
        if position in wanted:
            found.append(deviation)
    return found[0] if n % 2 else (found[0] + found[1]) / 2


def _another_ranks(norm: float | None, agreed: Agreement) -> Trigger | None:
    """The trigger of a rank whose own step is healthy while another rank saw a fault (every rank dumps the step)."""
    if not agreed.fault:
        return None
    return Trigger(
        TriggerKind.NONFINITE_GRAD,
        norm,
        None,
        None,
        "another rank saw a non-finite loss or gradient at this step",
        local=False,
    )


class StepDetectors:
    """Turns one step's host numbers into a Trigger (or None): non-finite loss, non-finite gradients
    (a GradScaler's ordinary overflow excepted until the scale collapses), then loss and grad-norm spikes (on a
    GradScaler overflow step, the loss alone: its grad norm is not a measurement).

    Adding a trigger kind: a member of forensics.core.kinds.TriggerKind, and its test here.
    """

    def __init__(self, config: GuardConfig):
        self.min_loss_scale = config.detection.min_loss_scale
        self.loss = SpikeDetector(config.detection.loss_spike)
        self.grad_norm = SpikeDetector(config.detection.grad_norm_spike)
        self.suppressed: list[Trigger] = []
        """After detect(): spikes that warm-up kept from firing (note_suppressed logs them)."""
        self._suppressed_logged: set[TriggerKind] = set()
        self._later: dict[TriggerKind, list[tuple[int, float | None]]] = {}
        """Spikes warm-up kept from firing after the first one logged, per kind: (step, value), said at its end."""

    def detect(
        self,
        losses: list[float],
        norm: float | None,
        step_loss: float | None,
        loss_scale: float | None,
        agreed: Agreement | None = None,
    ) -> Trigger | None:
        """This rank's trigger, if any. With several ranks (`agreed`), the spike detectors see the values
        agreed across ranks, so their windows, and so their verdicts, are identical on every rank; a rank whose own
        step is healthy while another saw a fault gets that rank's trigger (local=False)."""
        self.suppressed = []
        for index, value in enumerate(losses):
            if not math.isfinite(value):
                return Trigger(
                    TriggerKind.NONFINITE_LOSS, value, None, index, f"loss of micro-batch {index + 1} is {value}"
                )  # words count from 1
        overflow = False
        if norm is not None and not math.isfinite(norm):  # None: no gradients to measure, not a fault
            if agreed is not None and agreed.loss_fault:
                return _another_ranks(norm, agreed)  # its non-finite loss reached these gradients (the all-reduce)
            if loss_scale is None:
                return Trigger(
                    TriggerKind.NONFINITE_GRAD,
                    norm,
                    None,
                    None,
                    f"gradient norm is {norm} with a finite loss"
                    if losses
                    else f"gradient norm is {norm} (the loss is unknown: record_loss was not called)",
                )
            if loss_scale <= self.min_loss_scale:
                return Trigger(
                    TriggerKind.NONFINITE_GRAD,
                    norm,
                    self.min_loss_scale,
                    None,
                    f"gradients overflow and the loss scale has collapsed to {loss_scale}",
                )
            overflow = True  # a normal GradScaler overflow: it skips the step and lowers the scale. Its loss is still
            # a real loss, judged for a spike below; its overflowed norm means nothing: the grad-norm detector never
            # sees it
        own_loss, own_norm, where = step_loss, norm, ""
        if agreed is not None:
            if agreed.fault:
                return _another_ranks(norm, agreed)  # the spike windows stay as they are
            step_loss, norm, where = agreed.step_loss, agreed.grad_norm, " (agreed across ranks)"
        if overflow:
            norm = own_norm = None
        worst = max(range(len(losses)), key=lambda i: losses[i]) if losses else None
        limit = self.loss.observe(step_loss)
        if limit is not None:
            return Trigger(
                TriggerKind.LOSS_SPIKE,
                step_loss,
                limit,
                worst,
                f"loss {step_loss:.4g}{where} is above the spike threshold {limit:.4g}",
                local=own_loss is not None and own_loss > limit,
            )
        early_loss = self.loss.suppressed
        limit = self.grad_norm.observe(norm)
        if limit is not None:
            return Trigger(
                TriggerKind.GRAD_NORM_SPIKE,
                norm,
                limit,
                worst,
                f"grad norm {norm:.4g}{where} is above the spike threshold {limit:.4g}",
                local=own_norm is not None and own_norm > limit,
            )
        for kind, observed, early, detector, name in (
            (TriggerKind.LOSS_SPIKE, step_loss, early_loss, self.loss, "loss"),
            (TriggerKind.GRAD_NORM_SPIKE, norm, self.grad_norm.suppressed, self.grad_norm, "grad norm"),
        ):
            if early is not None:
                self.suppressed.append(
                    Trigger(
                        kind,
                        observed,
                        early,
                        worst,
                        (
                            f"{name} {observed:.4g}{where} is above {early:.4g}, a spike by the steps seen so far, but spike "
                            f"detection is still warming up ({len(detector._window) - 1} of {detector.config.warmup} steps; "
                            f"SpikeConfig.warmup): not dumped"
                        ),
                    )
                )
        return None

    def note_suppressed(self, step: int, fault: bool = False) -> str | None:
        """Logs (once per kind and run) a spike that warm-up kept from firing at `step`, with the warm-up that would
        have caught it; the later ones of the same warm-up are counted and said in one line when it ends, or when a
        fault (`fault`: this step triggered) comes first (`_end_of_warmup`). Returns the kind for the history, or
        None."""
        self._end_of_warmup(step, fault)
        if not self.suppressed:
            return None
        first = self.suppressed[0]
        detector = self.loss if first.kind is TriggerKind.LOSS_SPIKE else self.grad_norm
        if first.kind not in self._suppressed_logged:
            self._suppressed_logged.add(first.kind)
            log.warning(
                "forensics: step %d: %s. %s Logged once; every such step is marked in the history (column "
                "'suppressed').",
                step,
                first.detail,
                warmup_advice(first.kind, len(detector._window) - 1, detector.config.warmup),
            )
        else:
            seen = self._later.setdefault(first.kind, [])
            seen.append((step, first.value))
        return first.kind.value

    def _end_of_warmup(self, step: int, fault: bool = False) -> None:
        """One line for the spikes warm-up kept from firing after the first one logged, once that warm-up is over or
        a fault ends it first (never a line per step)."""
        for kind, seen in list(self._later.items()):
            detector = self.loss if kind is TriggerKind.LOSS_SPIKE else self.grad_norm
            if (detector.warming_up and not fault) or not seen:
                continue
            del self._later[kind]
            largest = max((v for _, v in seen if v is not None), default=None)
            log.warning(
                "forensics: spike detection (%s) %s at step %d; %d more step(s) during warm-up "
                "(steps %d-%d, largest %s) were spikes by the steps seen so far, not dumped (marked 'suppressed' in "
                "the history).",
                kind.value,
                "was still warming up when a fault came" if detector.warming_up else "has warmed up",
                step,
                len(seen),
                seen[0][0],
                seen[-1][0],
                f"{largest:.4g}" if largest is not None else "n/a",
            )


def warmup_advice(kind: TriggerKind, position: int, warmup: int) -> str:
    """How to catch a spike that came `position` finite values into a detector warming up over `warmup`: the warm-up
    that judges it (the value at `position` is judged once `position` values are in the window), or, before the
    smallest warm-up SpikeConfig allows, what that minimum catches. GuardConfig's SpikeConfig fields are named after
    their kinds."""
    where = f"GuardConfig(detection=DetectionConfig({kind.value}=SpikeConfig(warmup=%d)))"
    if MIN_WARMUP <= position < warmup:
        return (
            f"Early spikes are not dumped; {where % position} (now {warmup}) would have caught this one with the "
            "same threshold."
        )
    if position < MIN_WARMUP and MIN_WARMUP < warmup:
        return (
            f"No warm-up can judge a value this early (SpikeConfig.warmup >= {MIN_WARMUP}, now {warmup}); "
            f"{where % MIN_WARMUP} judges spikes from the {MIN_WARMUP + 1}th finite value on. A NaN/Inf is caught "
            "whatever the warm-up."
        )
    return (
        f"No warm-up can judge a value this early (SpikeConfig.warmup >= {MIN_WARMUP}, the current one); a NaN/Inf "
        "is caught whatever the warm-up."
    )


def clipped(norm: float | None, max_grad_norm: float | None) -> bool | None:
    """Whether the loop's clipping (GuardConfig.detection.max_grad_norm) fired at this norm (None: unknown)."""
    if max_grad_norm is None or norm is None or not math.isfinite(norm):
        return None
    return norm > max_grad_norm
