"""PaLM's ablation, built in: feed the culprit samples to an earlier state of the model and see whether they still fail.

PaLM (Chowdhery et al. 2022, §5.1) trained the batches around each loss spike from an earlier checkpoint and saw no
spike: a spike is specific data meeting a particular parameter state. A bad record hurts any state; a trigger is
harmless to a state that was not yet at the edge. So when an earlier state is at hand — the Guard's host snapshot in
the dump (RecordConfig.snapshot_every), or the checkpoint of `--from` — the step's samples are replayed one at a
time on it (the dumped step's data, the earlier weights) and the culprits are compared with the others there:

* a NaN/Inf trigger: does a culprit still make its loss or gradients non-finite?
* a spike: does a culprit still stand out — its gradient norm (grad-norm spike) or loss (loss spike) at least
  SPIKE_RATIO x the other samples' median on that state?

Either way the answer goes into the report (`evidence.earlier_state`); "still fails" is evidence against the record.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

from forensics.core.kinds import EvidenceKind, TriggerKind
from forensics.report.wording import fmt_id, fmt_num
from forensics.replay.culprits.evidence import Evidence, RecordEvidence
from forensics.replay.culprits.per_sample import per_sample_stats
from forensics.replay.load.samples import select_samples
from forensics.replay.run.execute import SampleRef, StepRunner

logger = logging.getLogger(__name__)

SPIKE_RATIO = 3.0
"""A culprit 'still stands out' on the earlier state when its number is at least this many times the other samples'
median there (the grad-norm spike detector's min_ratio)."""
MAX_OTHERS = 15
"""The other samples replayed on the earlier state to compare with (each is one forward and backward)."""


@dataclass(frozen=True)
class EarlierState:
    """An earlier state of the model: its weights by parameter name, and where they come from."""

    weights: dict[str, torch.Tensor]
    step: int | None
    source: str


def _number(row: dict, kind: TriggerKind) -> Any:
    return row.get("loss") if kind is TriggerKind.LOSS_SPIKE else row.get("grad_norm")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def feed_earlier_state(
    runner: StepRunner,
    earlier: EarlierState,
    culprits: list[SampleRef],
    kind: TriggerKind,
    evidence: RecordEvidence,
    dumped_step: int | None,
) -> None:
    """Replays the culprits and up to MAX_OTHERS other samples of the step on `earlier`, and writes the outcome into
    `evidence` (its sentence; an EARLIER_STATE entry when a culprit still fails). Never raises."""
    session = runner.session
    chosen = set(culprits)
    others = [r for r in session.sample_refs if r not in chosen][:MAX_OTHERS]
    refs = sorted([*culprits, *others], key=lambda r: (r.micro_batch, r.index))
    try:
        rows = _rows_on(runner, earlier, refs)
    except Exception as exc:  # noqa: BLE001 - an extra: the verdict stands without it
        logger.warning("the culprits could not be fed to the earlier state (%s: %s)", type(exc).__name__, exc)
        evidence.earlier = f"The culprit could not be fed to {earlier.source} ({type(exc).__name__})."
        return
    by_ref = {(r["micro_batch"], r["index"]): r for r in rows}
    culprit_rows = [by_ref[(c.micro_batch, c.index)] for c in culprits if (c.micro_batch, c.index) in by_ref]
    other_values = [v for o in others if _finite(v := _number(by_ref.get((o.micro_batch, o.index), {}), kind))]
    ago = (
        f", {dumped_step - earlier.step} steps earlier" if earlier.step is not None and dumped_step is not None else ""
    )
    where = f"{earlier.source}{ago}"
    still = []
    for row in culprit_rows:
        value = _number(row, kind)
        if not kind.spike:
            failed = not row.get("finite", True) or not _finite(row.get("loss"))
        else:
            median = statistics.median(other_values) if other_values else None
            failed = not _finite(value) or (median is not None and median > 0 and value >= SPIKE_RATIO * median)
        if failed:
            still.append((row, value))
    measure = "loss" if kind is TriggerKind.LOSS_SPIKE else "gradient norm"
    spread = (
        f" against {fmt_num(min(other_values), 3)}-{fmt_num(max(other_values), 3)} for the other "
        f"{len(other_values)} samples"
        if other_values
        else ""
    )
    if still:
        row, value = still[0]
        what = (
            "still makes its loss or gradients non-finite"
            if not kind.spike
            else f"still stands out there (its {measure} {fmt_num(value, 3)}{spread})"
        )
        words = f"fed to {where}, it {what}: the record hurts an earlier state too"
        evidence.against.append(Evidence(EvidenceKind.EARLIER_STATE, row["sample_id"], words))
        evidence.earlier = f"Fed to {where}, sample {fmt_id(row['sample_id'], 80)} {what} → the data, not the state."
    else:
        sample = fmt_id(culprits[0].sample_id, 80) if culprits else "the culprit"
        values = [_number(r, kind) for r in culprit_rows]
        own = f" (its {measure} {fmt_num(values[0], 3)}{spread})" if values and _finite(values[0]) else ""
        evidence.clear_by_earlier_state()
        evidence.earlier = f"Fed to {where}, sample {sample} is healthy{own} → the state, not the data (PaLM's test)."


@dataclass(frozen=True)
class EarlierRows:
    """The step's samples, each alone on an earlier state (the per-sample table's rows there): what the diverged
    step's samples do on weights from before (replay/judge/verdict_facts.diverged_here tells state from data by it)."""

    source: str
    """Where the earlier weights come from, with how many steps earlier ('the Guard's host snapshot of step 0 (in the
    dump), 4 steps earlier')."""
    rows: list[dict]


def rows_on_earlier_state(
    runner: StepRunner, earlier: EarlierState, refs: list[SampleRef], dumped_step: int | None
) -> EarlierRows | None:
    """Each of `refs` (up to MAX_OTHERS + 1) alone on `earlier`; None when that could not run (logged: the verdict
    then says the test did not run)."""
    try:
        rows = _rows_on(runner, earlier, sorted(refs, key=lambda r: (r.micro_batch, r.index))[: MAX_OTHERS + 1])
    except Exception as exc:  # noqa: BLE001 - an extra: the verdict stands without it
        logger.warning("the step's samples could not be fed to the earlier state (%s: %s)", type(exc).__name__, exc)
        return None
    ago = (
        f", {dumped_step - earlier.step} steps earlier" if earlier.step is not None and dumped_step is not None else ""
    )
    return EarlierRows(f"{earlier.source}{ago}", rows)


def _rows_on(runner: StepRunner, earlier: EarlierState, refs: list[SampleRef]) -> list[dict]:
    """Each sample of `refs` alone on the earlier weights: loss, gradient norm, finite (the per-sample table's rows)."""
    session, model = runner.session, runner.model
    runner.reset()
    _put_weights(model, earlier.weights)
    model.train()

    def run_one(ref: SampleRef) -> torch.Tensor:
        batch = select_samples(session.micro_batches[ref.micro_batch], [ref.index])
        with runner.autocast_context():
            return session.loss_fn(model, batch)

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        with runner.autocast_context():
            return session.loss_fn(m, batch)

    before_each: Callable[[SampleRef], None] = lambda ref: runner.restore_rng(ref.micro_batch)  # noqa: E731
    try:
        with runner.job_precision():
            return [
                dict(r)
                for r in per_sample_stats(
                    model, refs, run_one, before_each=before_each, batches=session.micro_batches, loss_fn=loss_fn
                )
            ]
    finally:
        runner.reset()


def _put_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """The earlier weights into the model, in its dtypes and on its device (every parameter must be there)."""
    from forensics.core.errors import RecipeError

    params = dict(model.named_parameters())
    missing = [n for n in params if n not in weights]
    if missing:
        raise RecipeError(f"the earlier state has no weights for {missing[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            value = weights[name]
            if tuple(value.shape) != tuple(p.shape):
                raise RecipeError(f"the earlier state's {name} is {tuple(value.shape)}, the model's {tuple(p.shape)}")
            p.copy_(value.to(device=p.device, dtype=p.dtype))


__all__ = ["EarlierState", "feed_earlier_state", "SPIKE_RATIO"]
