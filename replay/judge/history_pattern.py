"""Read the loss history before a crash: which curve shape it was, and other warning signals.

`classify_history` names the shape of the loss curve leading to the trigger, after the table
practitioners use to read a loss curve before a blow-up:

| pattern                  | example                                  | usual cause                      |
|--------------------------|------------------------------------------|----------------------------------|
| `sudden_jump`            | 1.6, 1.5, 1.4, 87234.5, NaN              | one bad sample, or an overflow   |
| `exponential_growth`     | 2.1, 2.3, 2.8, 4.5, 12.3, 89.7, NaN      | LR too high, accumulation bug    |
| `oscillating_divergence` | 2.0, 1.8, 2.2, 1.6, 2.5, 1.4, 3.2, NaN   | corrupted optimiser state        |
| `diverged`               | 4.2, 7.2, 13, 15, 12, 9.4 ... 7.6, 8.2   | LR too high, warm-up too short   |
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
* diverged (only with the run's first losses, or the uniform-guess loss, to compare with): the recent losses
  sit far above where the run started (`divergence_limit`), so the run is never "stable";
* oscillating divergence: the last >= 4 steps alternate in sign, with swings of at least 25% that
  grow (second half >= 1.5x the first, last >= 2x the first) and stand out of the earlier noise.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from statistics import median
from typing import Any, Sequence

from forensics.format.jsonio import lenient_float
from forensics.core.kinds import HistoryPattern
from forensics.report.wording import fmt_num

log = logging.getLogger(__name__)


DIVERGED_FACTOR = 3.0  # a loss this many times the run's start, held for a while, is a diverged run
UNIFORM_FACTOR = 1.5  # ... or this many times the loss of a uniform guess over the vocabulary
DIVERGED_FOR = 8  # ... for at least this many recorded steps before the trigger (diverged_long_ago)
MIN_POINTS = 4  # fewer finite losses than this tell nothing about a trend
WINDOW = 64  # the crash is explained by the recent past, not by warm-up long ago
GROWTH_FACTOR = 4.0  # sustained growth must at least quadruple the loss
MAX_STEP_SHARE = 0.7  # ... with no single step making most of it (that would be a jump)
JUMP_FACTOR = 2.0  # a jump at least doubles the loss in one step
JUMP_VS_NOISE = 10.0  # ... and is ten times the usual step size
JUMP_RECENT = 3  # ... and is one of the last 3 steps before the trigger
SWING_MIN = math.log(1.25)  # oscillation swings of at least 25%
NOISE_FLOOR = 1e-3  # median step size never counts as smaller than 0.1%


def _finite_values(values: Sequence[Any]) -> list[float]:
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


RECENT = 8  # "the loss sits above": the median of this many last finite losses


BACK_FOR = 4  # recorded steps in a row back where the run started: the loss came back (a spike recovered)


def divergence_limit(first_losses: Sequence[float | None], uniform_loss: float | None = None) -> float:
    """The loss above which a run has left where it started: DIVERGED_FACTOR x its start (the least of its first
    3 losses: a run that blows up at once has huge first losses), or 1.5 x the uniform-guess loss when known
    (a random-init language model starts right at ln(vocabulary)); inf when neither is known."""
    first = [v for v in _finite_values(first_losses)[:3]]
    start = min(first) if first else None
    limit = DIVERGED_FACTOR * start if start is not None and start > 0 else math.inf
    if uniform_loss is not None and uniform_loss > 0:
        limit = min(limit, UNIFORM_FACTOR * uniform_loss)
    return limit


def _sits_above(values: list[float], limit: float) -> bool:
    recent = values[-RECENT:]
    return math.isfinite(limit) and len(recent) >= MIN_POINTS and median(recent) > limit


def _is_exponential(steps: list[float]) -> bool:
    for k in range(3, len(steps) + 1):
        tail = steps[-k:]
        ups = [s for s in tail if s > 0]
        growth = sum(tail)
        if len(ups) >= 0.75 * k and growth >= math.log(GROWTH_FACTOR) and max(ups) <= MAX_STEP_SHARE * sum(ups):
            return True
    return False


def _is_sudden_jump(steps: list[float], noise: float) -> bool:
    start = max(len(steps) - JUMP_RECENT, 0)
    j = max(range(start, len(steps)), key=lambda i: steps[i])
    before = [abs(s) for s in steps[max(j - 6, 0) : j]]
    scale = max(noise, median(before)) if before else noise  # must stand out of recent swings too
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
    return (
        max(swings) >= SWING_MIN
        and sum(second) / half >= 1.5 * sum(first) / half
        and swings[-1] >= 2 * swings[0]
        and sum(second) / half >= 3 * baseline
        and swings[-1] >= 5 * baseline
    )


def classify_history(
    losses: Sequence[float | None], first_losses: Sequence[float | None] = (), uniform_loss: float | None = None
) -> HistoryPattern:
    """Name the shape of the loss curve before the trigger (a forensics.core.kinds.HistoryPattern).

    Args:
        losses: recorded losses, oldest first; None / NaN / inf entries (the trigger itself,
            skipped steps) are ignored.
        first_losses: the run's first recorded losses (history `summary.first_losses`), the baseline
            "diverged" compares with.
        uniform_loss: the loss of a uniform guess (ln(vocabulary) for a language model), if known.
    Returns:
        "sudden_jump", "exponential_growth", "diverged", "oscillating_divergence", "stable" or
        "insufficient_history" (fewer than 4 finite points).
    Example:
        >>> classify_history([1.6, 1.5, 1.4, 87234.5, float("nan")])
        'sudden_jump'
        >>> classify_history([2.1, 2.3, 2.8, 4.5, 12.3, 89.7, float("nan")])
        'exponential_growth'
    """
    values = _finite_values(losses)[-WINDOW:]
    if len(values) < MIN_POINTS:
        return HistoryPattern.INSUFFICIENT_HISTORY
    y = _log_space(values)
    steps = [b - a for a, b in zip(y, y[1:])]
    noise = max(median(abs(s) for s in steps), NOISE_FLOOR)
    if _is_exponential(steps) or _is_exponential(steps[:-1]):
        return HistoryPattern.EXPONENTIAL_GROWTH
    if _sits_above(values, divergence_limit(first_losses, uniform_loss)):
        return HistoryPattern.DIVERGED
    if _is_sudden_jump(steps, noise):
        return HistoryPattern.SUDDEN_JUMP
    if _is_oscillating(steps):
        return HistoryPattern.OSCILLATING_DIVERGENCE
    return HistoryPattern.STABLE


# --- other signals from the field notes -------------------------------------------------------

CLIP_FRACTION = 0.01  # clipping on more than ~1% of steps is a warning, not a fix
LOW_GRAD_NORM = 0.1  # a grad norm long below this means the model is not learning
LOW_GRAD_STEPS = 20  # "long": this many recorded steps in a row
OVERFLOW_REPEATS = 3  # loss-scale overflows that keep coming back
MIN_LOSS_SCALE = 1.0  # GradScaler has no floor; DeepSpeed's min_loss_scale defaults to 1


def _column(history: dict, key: str, n: int) -> list:
    values = list(history.get(key) or [])
    return (values + [None] * n)[:n]


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
        signals.append(
            f"Gradient clipping fired on {hits} of {len(clipped)} recorded steps "
            f"({100 * hits / len(clipped):.0f}%): clipping hides an optimiser or data problem "
            "rather than fixing it; look at the learning rate and the data."
        )

    grads: list[tuple[Any, float]] = []
    for s, raw in zip(steps, _column(history, "grad_norm", n)):
        g = lenient_float(raw)
        if g is not None and math.isfinite(g):
            grads.append((s, g))
    run = 0
    for _, g in reversed(grads):
        if not g < LOW_GRAD_NORM:
            break
        run += 1
    if run >= LOW_GRAD_STEPS and any(g > 0 for _, g in grads[-run:]):
        signals.append(
            f"Gradient norm stayed below {LOW_GRAD_NORM} for the last {run} recorded steps: "
            "the model is barely learning (vanishing gradients, too low a learning rate, "
            "or a loss-scale problem)."
        )
    for (_, before), (step, now) in reversed(list(zip(grads, grads[1:]))):
        if now == 0.0 and before > 0.0:
            signals.append(
                f"Gradient norm dropped to exactly 0 at step {step} (it was {fmt_num(before, 3)} the "
                "step before): dead units, or fp16 gradients underflowing because of the loss scale."
            )
            break

    scales = [(s, lenient_float(v)) for s, v in zip(steps, _column(history, "loss_scale", n))]
    skipped = _column(history, "skipped", n)
    overflow_steps = {s for s, k in zip(steps, skipped) if k}
    known = [(s, v) for s, v in scales if v is not None and math.isfinite(v)]
    overflow_steps.update(s for (_, a), (s, b) in zip(known, known[1:]) if b < a)
    if len(overflow_steps) >= OVERFLOW_REPEATS and known:
        first, last = known[0][1], known[-1][1]
        text = (
            f"The fp16 loss scale overflowed on {len(overflow_steps)} recorded steps "
            f"(scale {fmt_num(first, 3)} -> {fmt_num(last, 3)})"
        )
        if last <= MIN_LOSS_SCALE:
            text += (
                f" and collapsed to the minimum (<= {fmt_num(MIN_LOSS_SCALE, 3)}): fp16 overflows on every step; "
                "switch to bf16 or find the activation that overflows."
            )
        else:
            text += (
                ": steps are being skipped; if it keeps falling, switch to bf16 or find the activation that overflows."
            )
        signals.append(text)
    elif len(overflow_steps) >= OVERFLOW_REPEATS:
        signals.append(
            f"{len(overflow_steps)} recorded steps were skipped (loss-scale overflow): fp16 overflow keeps repeating."
        )
    return signals


def diverged_long_ago(history: dict, uniform_loss: float | None = None) -> str | None:
    """A sentence when the run was already far off before the dumped step, else None.

    The run's first recorded losses (history `summary.first_losses`, kept since step 0) are its baseline.
    Diverged: the median of the recorded losses before the trigger is DIVERGED_FACTOR x that baseline or more
    (or above `uniform_loss`, the loss of a uniform guess, ln(vocabulary) for a language model) over at least
    DIVERGED_FOR steps. Then a spike at the dumped step is a symptom of that run, not a cause.
    """
    first = _first_losses(history)
    losses = [lenient_float(v) for v in (history.get("loss") or [])][:-1]  # the last entry is the dumped step
    steps = list(history.get("step") or [])[: len(losses)]
    recent = [(s, v) for s, v in zip(steps, losses) if v is not None and math.isfinite(v)]
    if not first or len(recent) < DIVERGED_FOR:
        return None
    limit = divergence_limit(first, uniform_loss)
    above = [(s, v) for s, v in recent if v > limit]
    if len(above) < DIVERGED_FOR or median(v for _, v in recent) <= limit:
        return None
    since = above[0][0]
    low, high = min(v for _, v in recent), max(v for _, v in recent)
    bound = (
        f", above the {fmt_num(uniform_loss, 3)} of a uniform guess over the vocabulary"
        if uniform_loss is not None and median(v for _, v in recent) > uniform_loss
        else ""
    )
    return (
        f"The run had diverged long before this step: its loss started at {fmt_num(first[0], 3)} and has been "
        f"{fmt_num(low, 3)}-{fmt_num(high, 3)} since step {since}{bound}, so this step's numbers are a symptom "
        "of that run, not of one sample."
    )


def _first_losses(history: dict) -> list[float]:
    summary = history.get("summary")
    if not isinstance(summary, dict):
        summary = {}
    first = _finite_values(summary.get("first_losses") or [])
    return first or _finite_values((history.get("loss") or [])[:3])


@dataclass(frozen=True)
class HistoryReading:
    """What the recorded history shows about the run before it broke, with numbers from BEFORE the divergence."""

    onset: int | None
    """The first recorded step from which the loss stayed out of where the run started (above `divergence_limit`,
    or non-finite); None when it never left, or came back to stay (a one-step spike that recovered)."""
    healthy_grad_norm: float | None
    """The median grad norm of the recorded steps before `onset` (or before the analysed step): a clipping
    threshold from healthy steps, never from diverged ones."""
    healthy_steps: int
    sentences: list[str]
    healthy_loss_ceiling: float | None = None
    """The top of the run's recorded healthy loss range: the largest finite loss of the recorded steps before `onset`
    (or before the analysed step), and at least where the run counts as having left its start (`divergence_limit`);
    None without recorded losses. A loss far above it is no baseline to judge one record's loss against."""
    """'The loss started at 1.03 (step 0) and left it at step 1 (4.47e+04) ...', the learning rate, clipping."""


def read_history(history: dict | None, step: int | None, uniform_loss: float | None = None) -> HistoryReading:
    """What the history says before `step` (the analysed step): where the loss left its start, the learning
    rate then (constant, still warming up), clipping, and the healthy steps' gradient norm.

    Example:
        >>> r = read_history({"step": [0, 1, 2, 3], "loss": [1.03, 4.5e4, 2.4e20, float("inf")],
        ...                   "grad_norm": [0.997, 6994.0, 5.1e15, float("nan")], "lr": [50.0] * 4}, 3)
        >>> r.onset, r.healthy_grad_norm
        (1, 0.997)
    """
    history = history or {}
    n = max((len(v) for v in history.values() if isinstance(v, list)), default=0)
    steps = [s if isinstance(s, int) else i for i, s in enumerate(_column(history, "step", n))]
    losses = [lenient_float(v) for v in _column(history, "loss", n)]
    norms = [lenient_float(v) for v in _column(history, "grad_norm", n)]
    rates = [lenient_float(v) for v in _column(history, "lr", n)]
    clipped = _column(history, "clipped", n)
    first = _first_losses(history)
    limit = divergence_limit(first, uniform_loss)
    onset = _stayed_out_since(steps, losses, limit)
    cutoff = onset if onset is not None else step if step is not None else (steps[-1] + 1 if steps else 0)
    healthy = [i for i, s in enumerate(steps) if s < cutoff]
    good_norms = sorted(v for v in (norms[i] for i in healthy) if v is not None and math.isfinite(v) and v > 0)
    typical = good_norms[len(good_norms) // 2] if good_norms else None
    sentences = []
    if first and onset is not None and onset in steps and (step is None or onset < step):  # not the failure itself
        at = steps.index(onset)
        later = [(s, v) for s, v in zip(steps[at:], losses[at:]) if v is not None][:4]
        path = ", ".join(f"{fmt_num(v, 3)} (step {s})" for s, v in later)
        at_loss = losses[at]  # not None: the onset is a recorded loss
        why = (
            "non-finite"
            if at_loss is not None and not math.isfinite(at_loss)
            else f"above {fmt_num(UNIFORM_FACTOR, 2)} x the {fmt_num(uniform_loss, 3)} of a uniform guess over the "
            "vocabulary"
            if uniform_loss is not None and limit < DIVERGED_FACTOR * min(first[:3])
            else f"over {fmt_num(DIVERGED_FACTOR, 2)} x its start"
        )
        sentences.append(
            f"What the history shows: the loss started at {fmt_num(min(first[:3]), 3)} and left it at "
            f"step {onset} ({why}): {path}."
        )
    lr_words = _lr_words(steps, rates, onset if onset is not None else step)
    if lr_words:
        sentences.append(lr_words)
    known = [bool(c) for i, c in enumerate(clipped) if c is not None and i in set(healthy)]
    if typical is not None:
        clip = (
            f"clipping fired on {sum(known)} of those {len(known)} steps"
            if known
            else "clipping: not recorded (GuardConfig(detection=DetectionConfig(max_grad_norm=...)) tells the Guard the "
            "loop's threshold)"
        )
        steps_words = (
            f"median of {len(good_norms)} healthy recorded steps"
            if len(good_norms) > 1
            else "the one healthy recorded step"
        )
        sentences.append(f"Before that, the gradient norm was {fmt_num(typical, 3)} ({steps_words}); {clip}.")
    good_losses = [v for v in (losses[i] for i in healthy) if v is not None and math.isfinite(v)]
    bounds = good_losses + ([limit] if math.isfinite(limit) else [])
    ceiling = max(bounds) if bounds and any(v is not None for v in losses) else None
    return HistoryReading(onset, typical, len(good_norms), sentences, ceiling)


def _stayed_out_since(steps: list[int], losses: list[float | None], limit: float) -> int | None:
    """The first recorded step from which the loss was out of where the run started (above `limit`, or non-finite)
    without coming back for BACK_FOR recorded steps in a row. A loss that went out and came back to stay (a one-step
    spike that recovered, a first loss that fell) did not leave its start; one that swings in and out while it
    diverges did."""
    onset, back = None, 0
    for s, v in zip(steps, losses):
        if v is None:
            continue
        if not math.isfinite(v) or v > limit:
            onset, back = (s if onset is None else onset), 0
        else:
            back += 1
            if back >= BACK_FOR:
                onset = None
    return onset


def _lr_words(steps: list[int], rates: list[float | None], at: int | None) -> str | None:
    """The learning rate at the failure and the phase of its recorded schedule that led there, read from the last
    change: 'The learning rate was 50 at step 1, constant since step 0 (no warm-up in the recorded steps).',
    '..., still rising (warm-up) from 0.1 at step 2.', '..., falling since step 3 (from 0.6).', '..., constant
    since step 9, after rising from 0.1 at step 2.' Never 'rising' for a rate that fell or stayed flat last."""
    known = [(s, r) for s, r in zip(steps, rates) if r is not None and math.isfinite(r) and (at is None or s <= at)]
    if not known:
        return None
    s1, r1 = known[-1]
    text = f"The learning rate was {fmt_num(r1, 3)} at step {s1}"
    if len(known) == 1:
        return text + "."

    def same(a: float, b: float) -> bool:  # a scheduler's flat stretch repeats the same float
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0)

    flat = len(known) - 1
    while flat > 0 and same(known[flat - 1][1], known[flat][1]):
        flat -= 1
    if flat == 0:
        return text + f", constant since step {known[0][0]} (no warm-up in the recorded steps)."
    rising = known[flat][1] > known[flat - 1][1]
    start = flat - 1
    while (
        start > 0
        and not same(known[start - 1][1], known[start][1])
        and (known[start][1] > known[start - 1][1]) == rising
    ):
        start -= 1
    s0, r0 = known[start]
    if flat < len(known) - 1:
        return text + (
            f", constant since step {known[flat][0]}, after {'rising' if rising else 'falling'} from "
            f"{fmt_num(r0, 3)} at step {s0}."
        )
    if rising:
        return text + f", still rising (warm-up) from {fmt_num(r0, 3)} at step {s0}."
    return text + f", falling since step {s0} (from {fmt_num(r0, 3)})."
