"""Counterfactual fixes: re-run the failing step under each remedy that applies and say which make it healthy.

Each remedy (forensics.core.kinds.RemedyKind) changes one thing — drop the culprit samples, a non-zero Adam eps,
fp32, a lower loss scale, a lower clipping norm, a 10x lower learning rate, skipping the step — re-runs the
step from the pre-step state, applies the update with a fresh copy of the pre-step optimizer (one parameter
at a time) and measures: the step loss, the gradient norm, whether every weight is finite after the update,
and how far the update moves the weights relative to their norm. A step is *healthy* when its loss and gradients are
finite (a finite spike counts: the weights are what matter), every weight stays finite after the update,
and the update changes the weights by at most WRECK_RATIO of their norm (whole model, L2) in the one step. The results come ranked:
healthy remedies first, a fix of the cause before a fix of the symptom (RemedyKind.rank), each with the
exact change to make. "as recorded" (no change) is measured too: for a spike that is healthy as recorded,
no action is needed.

A window replay then carries each fix that made the step healthy over the next recorded steps
(replay/judge/remedy_followup.py); a single-step replay cannot, and the report says so.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, TypedDict


from forensics.report.wording import fp32_ran_words
from forensics.core.kinds import RemedyKind
from forensics.replay.judge.precision import uses_low_precision
from forensics.replay.localize.update import step_each_parameter
from forensics.replay.run.execute import SampleRef, StepRunner, any_nonfinite
from forensics.replay.run.update_size import WRECK_RATIO, relative_change

logger = logging.getLogger(__name__)

SAFE_EPS = 1e-8
LR_FACTOR = 0.1
LOSS_SCALE_FACTOR = 2.0**-8


class _Following(TypedDict):
    tested: bool


class Following(_Following, total=False):
    """How a fix fared over the recorded steps after the broken one (replay/judge/remedy_followup.py): `note` when it
    was not carried over; else `healthy`, the `steps` run, the `first_unhealthy` step and `why`."""

    healthy: bool
    steps: list[int]
    first_unhealthy: int | None
    why: str | None
    note: str


class _RemedyNumbers(TypedDict):
    kind: str
    words: str
    change: str
    healthy: bool | None
    step_loss: float | None
    grad_norm: float | None
    weights_finite: bool | None
    relative_change: float | None
    worst_parameter: str | None
    note: str
    setting: dict


class RemedyRow(_RemedyNumbers, total=False):
    """One tested remedy: a row of the report's `remedies.tested` (RemedyResult.as_dict, then `following`)."""

    following: Following


class RemediesBlock(TypedDict):
    """The report's `remedies` block: the tested rows, ranked, what healthy means, what the following steps say."""

    tested: list[RemedyRow]
    criteria: str
    following_steps: str


@dataclass
class RemedyResult:
    kind: RemedyKind
    change: str
    """The exact change to make, in the user's terms."""
    healthy: bool | None
    """None: could not be tested (the note says why)."""
    step_loss: float | None = None
    grad_norm: float | None = None
    weights_finite: bool | None = None
    relative_change: float | None = None
    """|update| / |weights| over the whole model (L2)."""
    worst_parameter: str | None = None
    """The parameter the update moved most."""
    note: str = ""
    setting: dict = field(default_factory=dict)
    """The change in machine form, for carrying it over the following steps (replay/judge/remedy_followup.py):
    {"drop": [sample ids]}, {"hyper": {"eps" | "lr": value}}, {"fp32": true}, {"clip": norm}, {"loss_scale": s},
    {"skip": true} or {} (as recorded)."""

    def as_dict(self) -> RemedyRow:
        return {
            "kind": self.kind.value,
            "words": self.kind.words,
            "change": self.change,
            "healthy": self.healthy,
            "step_loss": self.step_loss,
            "grad_norm": self.grad_norm,
            "weights_finite": self.weights_finite,
            "relative_change": self.relative_change,
            "worst_parameter": self.worst_parameter,
            "note": self.note,
            "setting": self.setting,
        }


def try_remedies(
    runner: StepRunner, culprits: list[SampleRef], clip_at: float | None, culprit_module: str | None = None
) -> RemediesBlock | None:
    """The report's `remedies` block: every applicable remedy tried on the step, ranked (module docstring).
    `clip_at`: the healthy steps' gradient norm (forensics.replay.judge.history_pattern.read_history: from before the loss left
    its start, never a diverged step's), the clipping threshold tried; None: clipping is not tried.
    None when the session has no optimizer state (no update to apply)."""
    session = runner.session
    if session.optimizer is None:
        return None
    hyper = _first_group(session.optimizer)
    results = [_evaluate(runner, RemedyKind.AS_RECORDED, "no change")]
    if culprits:
        ids = [r.sample_id for r in culprits]
        keep = [r for r in session.sample_refs if r not in set(culprits)]
        if keep:  # whether they are bad data, and so listed in a blocklist, is the verdict's to say
            results.append(_evaluate(runner, RemedyKind.DROP_SAMPLES, f"leave out samples {ids}", samples=keep))
    eps = hyper.get("eps")
    if isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps < SAFE_EPS:
        results.append(
            _evaluate(
                runner, RemedyKind.ADAM_EPS, f"eps={SAFE_EPS:g} in the optimizer (was {eps:g})", hyper={"eps": SAFE_EPS}
            )
        )
    if uses_low_precision(runner):
        where = (
            f"keep `{culprit_module}` in fp32 (torch.autocast(..., enabled=False) around its call, its input cast "
            "to float32), or "
            if culprit_module and "<" not in culprit_module
            else ""
        )  # <input>.x is data, no module
        results.append(_evaluate(runner, RemedyKind.FP32, f"{where}train without autocast / loss scaling", fp32=True))
    if session.loss_scale is not None:
        scale = session.loss_scale
        results.append(
            _evaluate(
                runner,
                RemedyKind.LOSS_SCALE,
                f"GradScaler(init_scale={scale * LOSS_SCALE_FACTOR:g}) (the step ran at {scale:g})",
                loss_scale=scale * LOSS_SCALE_FACTOR,
            )
        )
    if clip_at is not None:
        results.append(
            _evaluate(
                runner,
                RemedyKind.CLIP_GRAD,
                f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={clip_at:.3g}) "
                "(the median grad norm of the healthy recorded steps)",
                clip=clip_at,
            )
        )
    lr = hyper.get("lr")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0:
        results.append(
            _evaluate(runner, RemedyKind.LOWER_LR, f"lr={lr * LR_FACTOR:g} (was {lr:g})", hyper={"lr": lr * LR_FACTOR})
        )
    results.append(_skip(runner))
    ranked = sorted(results, key=lambda r: (r.healthy is not True, r.kind.rank))
    return {
        "tested": [r.as_dict() for r in ranked],
        "criteria": f"healthy = finite loss and gradients, every weight finite after the update, and the "
        f"update smaller than {WRECK_RATIO:.0%} of the weights' norm",
        "following_steps": "not tested: the dump holds this step only (a window replay, with --from or the "
        "Guard's host snapshot, carries each fix over the recorded steps after it)",
    }


def _evaluate(
    runner: StepRunner,
    kind: RemedyKind,
    change: str,
    *,
    samples: list[SampleRef] | None = None,
    hyper: dict | None = None,
    fp32: bool = False,
    clip: float | None = None,
    loss_scale: float | None = None,
) -> RemedyResult:
    """Runs the step with one change, applies the update, measures it (never raises: a remedy that cannot be
    tried is reported as such)."""
    result = RemedyResult(kind, change, None)
    if samples is not None:
        kept = set(samples)
        result.setting["drop"] = [r.sample_id for r in runner.session.sample_refs if r not in kept]
    for key, value in (("hyper", hyper), ("fp32", fp32 or None), ("clip", clip), ("loss_scale", loss_scale)):
        if value is not None:
            result.setting[key] = value
    try:
        with _scale(runner, loss_scale), runner.keeping_gradients():
            run = runner.run(samples, fp32=fp32, keep_grads=True)
        if fp32 and not runner.fp32_count.verified:  # the user's code kept computing below fp32: no conclusion
            result.note = f"could not be held to float32 ({fp32_ran_words(runner.fp32_count.as_dict())})"
            return result
        result.step_loss = run.comparable_loss if samples is not None else run.step_loss
        result.grad_norm = run.grad_norm
        if not (run.loss_finite and run.grads_finite) or run.norm_overflow:
            result.healthy, result.weights_finite = False, None
            result.note = (
                "the gradients' norm overflows before any update"
                if run.norm_overflow
                else "the loss or the gradients are non-finite before any update"
            )
            return result
        if clip is not None:
            runner.clip_gradients(clip)
        moved = size = 0.0
        worst, worst_name, finite = -1.0, None, True
        for step in step_each_parameter(runner.model, runner.session.optimizer, hyper, runner=runner):
            finite = finite and not step.broke and not any_nonfinite([step.param.detach()])[0]
            moved, size = moved + step.moved_sq, size + step.size_sq
            if step.moved_sq > worst:  # the parameter the update moved most, in absolute terms
                worst, worst_name = step.moved_sq, step.name
        moved_by = relative_change(moved, size)  # `change` is the remedy's description
        if not math.isfinite(moved_by):
            finite = False
        result.weights_finite, result.relative_change, result.worst_parameter = finite, moved_by, worst_name
        result.healthy = finite and moved_by <= WRECK_RATIO
        if finite and moved_by > WRECK_RATIO:
            result.note = (
                f"the update moves the weights by {moved_by:.0%} of their norm in one step (most: `{worst_name}`)"
            )
        return result
    except Exception as exc:  # noqa: BLE001 - one remedy that cannot run must not lose the others
        logger.warning("remedy %s could not be tried: %s: %s", kind.value, type(exc).__name__, exc)
        result.note = f"could not be tried ({type(exc).__name__}: {str(exc)[:160]})"
        return result
    finally:
        runner.reset()


def _skip(runner: StepRunner) -> RemedyResult:
    """Skipping the step keeps the pre-step weights: healthy exactly when they are finite; the data stays."""
    bad = runner.nonfinite_params
    return RemedyResult(
        RemedyKind.SKIP_STEP,
        "GuardConfig(detection=DetectionConfig(on_nonfinite='skip' / on_spike='skip')) (check() returns "
        "False; do not call optimizer.step())",
        healthy=not bad,
        weights_finite=not bad,
        relative_change=0.0,
        setting={"skip": True},
        note="hides the cause: the same data or state fails again when it comes back",
    )


@contextlib.contextmanager
def _scale(runner: StepRunner, scale: float | None) -> Iterator[None]:
    """The session's loss scale replaced for one run."""
    state = runner.session.scaler_state
    if scale is None or state is None:
        yield
        return
    original = state["scale"]
    state["scale"] = scale
    try:
        yield
    finally:
        state["scale"] = original


def _first_group(snapshot: Any) -> dict:
    return {k: v for k, v in (snapshot.param_groups[0] if snapshot.param_groups else {}).items() if k != "params"}


def tested_suggestions(
    block: RemediesBlock | None,
    limit: int = 3,
    diverged: bool = False,
    blames_data: bool = False,
    trigger: bool = False,
) -> tuple[list[str], list[str]]:
    """What the remedies showed, with their numbers: (lines that go before the verdict's own suggestions,
    lines that go after them). A fix that worked leads; skipping the step only hides the cause, so when it
    is the only thing that worked it is said last. `diverged`: the loss sits far above where the run started,
    so a step whose own update is harmless still needs action (never "no action needed")."""
    if not block:
        return [], []
    rows = block.get("tested") or []
    healthy = [r for r in rows if r.get("healthy") is True]
    if diverged and any(r["kind"] == RemedyKind.AS_RECORDED.value for r in healthy):
        row = next(r for r in healthy if r["kind"] == RemedyKind.AS_RECORDED.value)
        return [], [
            f"This step's own update is not what breaks the run (it changes the weights by "
            f"{_percent(row.get('relative_change'))} of their norm): the run had already diverged, so "
            "skipping or clipping this step does not bring it back."
        ]
    if any(r["kind"] == RemedyKind.AS_RECORDED.value for r in healthy):
        row = next(r for r in healthy if r["kind"] == RemedyKind.AS_RECORDED.value)
        harmless = (
            f"replayed as recorded, the step's update leaves every weight finite and changes the weights by "
            f"{_percent(row.get('relative_change'))} of their norm"
        )
        if blames_data:  # the job survived this step; the record is still worth removing (said once, below)
            return [], [
                f"The job survives this step ({harmless}): no restart is needed for it; filtering the record "
                "keeps it from coming back."
            ]
        if trigger:  # the step is harmless, the state that made an ordinary sample cross is not
            return [], [
                f"This step itself is harmless ({harmless}), but the state that made an ordinary sample "
                "cross is still there: expect more such steps."
            ]
        return [f"No action needed: {harmless}."], []
    fixes = [r for r in healthy if r["kind"] != RemedyKind.SKIP_STEP.value]
    first = [
        f"Tested fix ({row['words']}): {row['change']} — the step is then healthy (step loss "
        f"{_number(row.get('step_loss'))}, grad norm {_number(row.get('grad_norm'))}, weights change by "
        f"{_percent(row.get('relative_change'))}){_following_words(row.get('following'))}."
        for row in fixes[:limit]
    ]
    last = []
    failed = [r["words"] for r in rows if r.get("healthy") is False and r["kind"] != RemedyKind.AS_RECORDED.value]
    if failed:
        last.append(f"Tested and not enough on its own: {', '.join(failed)} (report section Remedies).")
    if not fixes and any(r["kind"] == RemedyKind.SKIP_STEP.value for r in healthy):
        last.append(
            "Tested: of the changes tried, only skipping the step keeps the weights healthy — it hides the "
            "cause, which comes back with the same data or state."
        )
    return first, last


def _following_words(following: Following | None) -> str:
    """How the fix fared over the recorded steps after this one (replay/judge/remedy_followup.py), as a clause."""
    if not following or not following.get("tested"):
        return ""
    if following.get("healthy"):
        steps = following.get("steps") or []
        return f", and so are the next {len(steps)} recorded steps ({', '.join(map(str, steps))})" if steps else ""
    return (
        f", but it only postpones the failure: step {following.get('first_unhealthy')} breaks again "
        f"({following.get('why')})"
    )


def _number(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) or isinstance(value, bool) else f"{value:.4g}"


def _percent(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) or isinstance(value, bool) else f"{value:.1%}"
