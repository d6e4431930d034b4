"""Read the loss history before a crash: which curve shape it was, and other warning signals.

`classify_history` names the shape of the loss curve leading to the trigger, after the table in
the field notes (../shared/FIELD-NOTES.md):

| pattern                  | example                                  | usual cause                      |
|--------------------------|------------------------------------------|----------------------------------|
| `sudden_jump`            | 1.6, 1.5, 1.4, 87234.5, NaN              | one bad sample, or an overflow   |
| `exponential_growth`     | 2.1, 2.3, 2.8, 4.5, 12.3, 89.7, NaN      | LR too high, accumulation bug    |
| `oscillating_divergence` | 2.0, 1.8, 2.2, 1.6, 2.5, 1.4, 3.2, NaN   | corrupted optimiser state        |
| `stable`                 | flat or noisy, then NaN out of nowhere   |                                  |
| `insufficient_history`   | fewer than 4 finite points               |                                  |

Only finite values count (None, NaN and inf are dropped), and only the last `WINDOW` of them. The
rules work on log-losses (signed log1p when a loss is <= 0), so "a step" means a ratio, and use
robust statistics (medians), so one outlier does not decide for the rest:

* exponential growth: over the last k >= 3 steps (or those before the very last point) at least
  3 in 4 steps go up, the loss grows at least `GROWTH_FACTOR`-fold, and no single step carries more
  than `MAX_STEP_SHARE` of that growth;
* sudden jump: one of the last 3 steps rises at least 2-fold and `JUMP_VS_NOISE` times both the
  median step size and the median of the 6 steps before it (so the last swing of an oscillation
  is no jump);
* oscillating divergence: the last >= 4 steps alternate in sign, with swings of at least 25% that
  grow (second half >= 1.5x the first, last >= 2x the first) and stand out of the earlier noise.
"""

from __future__ import annotations

import logging
import math
from statistics import median
from typing import Any, Sequence

from forensics.kinds import HistoryPattern
from forensics.report.wording import fmt_num

log = logging.getLogger(__name__)


MIN_POINTS = 4          # fewer finite losses than this tell nothing about a trend
WINDOW = 64             # the crash is explained by the recent past, not by warm-up long ago
GROWTH_FACTOR = 4.0     # sustained growth must at least quadruple the loss
MAX_STEP_SHARE = 0.7    # ... with no single step making most of it (that would be a jump)
JUMP_FACTOR = 2.0       # a jump at least doubles the loss in one step
JUMP_VS_NOISE = 10.0    # ... and is ten times the usual step size
JUMP_RECENT = 3         # ... and is one of the last 3 steps before the trigger
SWING_MIN = math.log(1.25)   # oscillation swings of at least 25%
NOISE_FLOOR = 1e-3      # median step size never counts as smaller than 0.1%


def _finite(values: Sequence[Any]) -> list[float]:
    out = []
    for v in values:
        if v is None or isinstance(v, bool):
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out.append(f)
    return out


def _log_space(values: list[float]) -> list[float]:
    if all(v > 0 for v in values):
        return [math.log(v) for v in values]
    return [math.copysign(math.log1p(abs(v)), v) for v in values]


def _is_exponential(steps: list[float]) -> bool:
    for k in range(3, len(steps) + 1):
        tail = steps[-k:]
        ups = [s for s in tail if s > 0]
        growth = sum(tail)
        if (len(ups) >= 0.75 * k and growth >= math.log(GROWTH_FACTOR)
                and max(ups) <= MAX_STEP_SHARE * sum(ups)):
            return True
    return False


def _is_sudden_jump(steps: list[float], noise: float) -> bool:
    start = max(len(steps) - JUMP_RECENT, 0)
    j = max(range(start, len(steps)), key=lambda i: steps[i])
    before = [abs(s) for s in steps[max(j - 6, 0):j]]
    scale = max(noise, median(before)) if before else noise   # must stand out of recent swings too
    return steps[j] >= math.log(JUMP_FACTOR) and steps[j] >= JUMP_VS_NOISE * scale


def _is_oscillating(steps: list[float]) -> bool:
    run = 1
    while run < len(steps) and steps[-run - 1] * steps[-run] < 0:
        run += 1
    if run < 4:
        return False
    swings = [abs(s) for s in steps[-run:]]
    half = run // 2
    first, second = swings[:half], swings[-half:]
    earlier = [abs(s) for s in steps[:-run]]
    baseline = median(earlier) if len(earlier) >= 3 else 0.0
    return (max(swings) >= SWING_MIN
            and sum(second) / half >= 1.5 * sum(first) / half
            and swings[-1] >= 2 * swings[0]
            and sum(second) / half >= 3 * baseline and swings[-1] >= 5 * baseline)


def classify_history(losses: Sequence[float | None]) -> HistoryPattern:
    """Name the shape of the loss curve before the trigger (a forensics.kinds.HistoryPattern).

    Args:
        losses: recorded losses, oldest first; None / NaN / inf entries (the trigger itself,
            skipped steps) are ignored.
    Returns:
        "sudden_jump", "exponential_growth", "oscillating_divergence", "stable" or
        "insufficient_history" (fewer than 4 finite points).
    Example:
        >>> classify_history([1.6, 1.5, 1.4, 87234.5, float("nan")])
        'sudden_jump'
        >>> classify_history([2.1, 2.3, 2.8, 4.5, 12.3, 89.7, float("nan")])
        'exponential_growth'
    """
    values = _finite(losses)[-WINDOW:]
    if len(values) < MIN_POINTS:
        return HistoryPattern.INSUFFICIENT_HISTORY
    y = _log_space(values)
    steps = [b - a for a, b in zip(y, y[1:])]
    noise = max(median(abs(s) for s in steps), NOISE_FLOOR)
    if _is_exponential(steps) or _is_exponential(steps[:-1]):
        return HistoryPattern.EXPONENTIAL_GROWTH
    if _is_sudden_jump(steps, noise):
        return HistoryPattern.SUDDEN_JUMP
    if _is_oscillating(steps):
        return HistoryPattern.OSCILLATING_DIVERGENCE
    return HistoryPattern.STABLE


# --- other signals from the field notes -------------------------------------------------------

CLIP_FRACTION = 0.01    # clipping on more than ~1% of steps is a warning, not a fix
LOW_GRAD_NORM = 0.1     # a grad norm long below this means the model is not learning
LOW_GRAD_STEPS = 20     # "long": this many recorded steps in a row
OVERFLOW_REPEATS = 3    # loss-scale overflows that keep coming back
MIN_LOSS_SCALE = 1.0    # GradScaler has no floor; DeepSpeed's min_loss_scale defaults to 1


def _column(history: dict, key: str, n: int) -> list:
    values = list(history.get(key) or [])
    return (values + [None] * n)[:n]


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def history_signals(history: dict) -> list[str]:
    """Plain-words warnings from the recorded history (field notes' "other signals").

    Args:
        history: `{"step", "loss", "grad_norm", "lr", "loss_scale", "clipped", "skipped"}`, lists
            oldest first, None where missing (as `Dump.history()` returns it); missing keys are fine.
    Returns:
        Zero or more sentences: clipping on more than 1% of steps; grad norm below 0.1 for 20 steps
        or more; grad norm suddenly exactly 0; fp16 loss-scale overflows that keep repeating
        (and whether the scale reached its minimum).
    Example:
        >>> history_signals({"step": [1, 2, 3], "grad_norm": [0.8, 0.9, 0.0]})[0][:60]
        'Gradient norm dropped to exactly 0 at step 3 (it was 0.9 the'
    """
    n = max((len(v) for v in history.values() if isinstance(v, list)), default=0)
    steps = [s if s is not None else i for i, s in enumerate(_column(history, "step", n))]
    signals: list[str] = []

    clipped = [c for c in _column(history, "clipped", n) if c is not None]
    hits = sum(bool(c) for c in clipped)
    if clipped and hits / len(clipped) > CLIP_FRACTION:
        signals.append(f"Gradient clipping fired on {hits} of {len(clipped)} recorded steps "
                       f"({100 * hits / len(clipped):.0f}%): clipping hides an optimiser or data problem "
                       "rather than fixing it; look at the learning rate and the data.")

    grads = [(s, _num(g)) for s, g in zip(steps, _column(history, "grad_norm", n))]
    grads = [(s, g) for s, g in grads if g is not None and math.isfinite(g)]
    run = 0
    for _, g in reversed(grads):
        if not g < LOW_GRAD_NORM:
            break
        run += 1
    if run >= LOW_GRAD_STEPS and any(g > 0 for _, g in grads[-run:]):
        signals.append(f"Gradient norm stayed below {LOW_GRAD_NORM} for the last {run} recorded steps: "
                       "the model is barely learning (vanishing gradients, too low a learning rate, "
                       "or a loss-scale problem).")
    for (_, before), (step, now) in reversed(list(zip(grads, grads[1:]))):
        if now == 0.0 and before > 0.0:
            signals.append(f"Gradient norm dropped to exactly 0 at step {step} (it was {fmt_num(before, 3)} the "
                           "step before): dead units, or fp16 gradients underflowing because of the loss scale.")
            break

    scales = [(s, _num(v)) for s, v in zip(steps, _column(history, "loss_scale", n))]
    skipped = _column(history, "skipped", n)
    overflow_steps = {s for s, k in zip(steps, skipped) if k}
    known = [(s, v) for s, v in scales if v is not None and math.isfinite(v)]
    overflow_steps.update(s for (_, a), (s, b) in zip(known, known[1:]) if b < a)
    if len(overflow_steps) >= OVERFLOW_REPEATS and known:
        first, last = known[0][1], known[-1][1]
        text = (f"The fp16 loss scale overflowed on {len(overflow_steps)} recorded steps "
                f"(scale {fmt_num(first, 3)} -> {fmt_num(last, 3)})")
        if last <= MIN_LOSS_SCALE:
            text += (f" and collapsed to the minimum (<= {fmt_num(MIN_LOSS_SCALE, 3)}): fp16 overflows on every step; "
                     "switch to bf16 or find the activation that overflows.")
        else:
            text += (": steps are being skipped; if it keeps falling, switch to bf16 or find the "
                     "activation that overflows.")
        signals.append(text)
    elif len(overflow_steps) >= OVERFLOW_REPEATS:
        signals.append(f"{len(overflow_steps)} recorded steps were skipped (loss-scale overflow): "
                       "fp16 overflow keeps repeating.")
    return signals


DIVERGED_FACTOR = 3.0    # a loss this many times the run's first losses, held for a while, is a diverged run
DIVERGED_FOR = 8         # ... for at least this many recorded steps before the trigger


def diverged_long_ago(history: dict, uniform_loss: float | None = None) -> str | None:
    """A sentence when the run was already far off before the dumped step, else None.

    The run's first recorded losses (history `summary.first_losses`, kept since step 0) are its baseline.
    Diverged: the median of the recorded losses before the trigger is DIVERGED_FACTOR x that baseline or more
    (or above `uniform_loss`, the loss of a uniform guess, ln(vocabulary) for a language model) over at least
    DIVERGED_FOR steps. Then a spike at the dumped step is a symptom of that run, not a cause.
    """
    summary = history.get("summary") if isinstance(history.get("summary"), dict) else {}
    first = _finite(summary.get("first_losses") or [])
    losses = [_num(v) for v in (history.get("loss") or [])][:-1]  # the last entry is the dumped step
    steps = list(history.get("step") or [])[:len(losses)]
    recent = [(s, v) for s, v in zip(steps, losses) if v is not None and math.isfinite(v)]
    if not first or len(recent) < DIVERGED_FOR:
        return None
    baseline = median(first[:3])
    limit = DIVERGED_FACTOR * baseline if baseline > 0 else math.inf
    if uniform_loss is not None:
        limit = min(limit, uniform_loss * 1.5)
    above = [(s, v) for s, v in recent if v > limit]
    if len(above) < DIVERGED_FOR or median(v for _, v in recent) <= limit:
        return None
    since = above[0][0]
    low, high = min(v for _, v in recent), max(v for _, v in recent)
    bound = (f", above the {fmt_num(uniform_loss, 3)} of a uniform guess over the vocabulary"
             if uniform_loss is not None and median(v for _, v in recent) > uniform_loss else "")
    return (f"The run had diverged long before this step: its loss started at {fmt_num(first[0], 3)} and has been "
            f"{fmt_num(low, 3)}-{fmt_num(high, 3)} since step {since}{bound}, so this step's numbers are a symptom "
            "of that run, not of one sample.")
