"""Trigger or cause: is the sample bisection named a bad record, or an ordinary one the model's state could not take?

Bisection names the smallest set of samples whose presence makes the step fail. That is not yet evidence against the
data: on a state at the edge (activations near fp16's max, attention logits grown for hundreds of steps, a learning
rate too high) the first sample to cross is whichever comes, and filtering it moves the failure to the next one
(PaLM, Chowdhery et al. 2022, §5.1: the suspect batches fed to an earlier checkpoint did not spike). A sample is blamed as bad data only
with evidence about the record itself, and the report shows it:

* its data is odd on its own (replay/culprits/sample_facts.py: NaN/Inf or extreme values, every label masked, no
  token attended, all zeros, long repeated n-grams — OLMo 2's repeated-n-gram spikes);
* its loss, replayed alone, is an outlier against the step's other samples (a mislabeled target): above
  LOSS_OUTLIER_RATIO x their median AND more than LOSS_OUTLIER_MADS robust deviations above it — against a baseline
  that is itself healthy only: every other sample's loss finite, and their median within the run's recorded range
  (the history's healthy steps, forensics.replay.judge.history_pattern.HistoryReading.healthy_loss_ceiling). On a
  diverged state every loss is 1e14; one at 3.7e14 says nothing about its record (issue 50);
* it makes the loss non-finite on its own in full precision (fp32 checked as it ran, or an fp32 job) while every
  other sample's loss stays finite (a log(0), a division by zero its data causes);
* fed to an earlier state (the Guard's host snapshot, or --from CHECKPOINT), it still fails or still stands out
  (replay/culprits/earlier_state.py). Healthy there, it is cleared: the measured evidence above (its loss, its
  non-finite loss alone) is overruled (`clear_by_earlier_state`); what is odd in its own data stands.

Otherwise the sample is a *trigger*: the verdict names it as the sample that crossed first, shows that its record looks
like the others (its loss and gradient against theirs), writes no blocklist and aims the advice at the state.
A large gradient with an ordinary loss is what a trigger looks like, not evidence against the record.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from forensics.core.kinds import EvidenceKind
from forensics.report.wording import fmt_id, fmt_num
from forensics.replay.culprits.sample_facts import SampleFact
from forensics.replay.run.execute import SampleRef

LOSS_OUTLIER_RATIO = 2.0
"""A culprit's loss must be at least this many times the other samples' median: a mislabeled or garbage target gives
a loss of several nats where the rest sit near the model's current level."""
LOSS_OUTLIER_MADS = 8.0
"""... and this many median absolute deviations above that median (the spike detector's robust rule), so a step
whose per-sample losses are naturally spread (mixed sources) does not make its largest one an outlier."""
MIN_OTHERS = 3
"""Fewer other samples than this give no reliable median: no loss-outlier evidence either way."""


@dataclass(frozen=True)
class Evidence:
    """One thing that shows a culprit's record itself is bad, in words the report prints."""

    kind: EvidenceKind
    sample_id: Any
    words: str


@dataclass
class RecordEvidence:
    """What the replay knows about whether the culprits' records are bad data (module docstring)."""

    against: list[Evidence] = field(default_factory=list)
    """Evidence that a culprit's record is bad: empty means the culprits are triggers."""
    ordinary: str | None = None
    """For triggers: how the culprit compares with the other samples ('its loss 4.2 against 4.1-4.24 for the other
    15 samples; its gradient norm 17.7 against 0.24-0.8'), the numbers behind 'its record looks like the others'."""
    earlier: str | None = None
    """The earlier-state ablation in one sentence, when it ran (replay/culprits/earlier_state.py)."""
    earlier_healthy: bool | None = None
    """The culprits, fed to the earlier state, were healthy there (None: no earlier state was fed)."""
    set_aside: list[str] = field(default_factory=list)
    """What was measured against a culprit but is no evidence, and why ('its loss alone 3.7e+14 ... is not weighed:
    the other samples are no healthy baseline ...'): the report shows it, the verdict does not count it."""

    refuted: list[str] = field(default_factory=list)
    """The replay's findings that contradict the evidence (replay/judge/verdict.refutations, written here by
    replay/judge/assemble.py): then the records are not called bad data whatever `against` holds."""

    @property
    def bad_data(self) -> bool:
        return bool(self.against) and not self.refuted

    def clear_by_earlier_state(self) -> None:
        """The culprits were healthy on an earlier state (PaLM's test): that overrules the evidence measured on this
        state (a loss outlier, a loss non-finite alone); what is odd in the record's own data stands."""
        self.earlier_healthy = True
        kept = []
        for e in self.against:
            if e.kind in (EvidenceKind.LOSS_OUTLIER, EvidenceKind.NONFINITE_ALONE):
                self.set_aside.append(f"{e.words} — overruled: the sample is healthy on the earlier state")
            else:
                kept.append(e)
        self.against = kept

    def as_dict(self) -> dict:
        out = {
            "bad_data": self.bad_data,
            "against": [{"kind": e.kind.value, "sample_id": e.sample_id, "words": e.words} for e in self.against],
            "ordinary": self.ordinary,
            "earlier_state": self.earlier,
        }
        if self.set_aside:
            out["set_aside"] = list(self.set_aside)
        if self.refuted:
            out["refuted_by"] = list(self.refuted)
        return out


def _range(values: Sequence[float]) -> str:
    low, high = min(values), max(values)
    return fmt_num(low, 3) if low == high else f"{fmt_num(low, 3)}-{fmt_num(high, 3)}"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def unhealthy_baseline(others: Sequence[Any], ceiling: float | None) -> str | None:
    """Why the other samples' losses are no baseline to call a loss an outlier against (None: they are one): one of
    them is non-finite alone, or their median is above `ceiling`, the top of the run's recorded healthy range."""
    finite = [v for v in others if _finite(v)]
    if len(finite) < len(others):
        return f"{len(others) - len(finite)} of the other {len(others)} samples are non-finite alone too"
    if ceiling is not None and math.isfinite(ceiling) and finite and statistics.median(finite) > ceiling:
        return (
            f"their median {fmt_num(statistics.median(finite), 3)} is far outside the run's recorded range "
            f"(healthy steps up to {fmt_num(ceiling, 3)}): the state, not one record, makes every loss large"
        )
    return None


def loss_outlier(loss: Any, others: Sequence[float]) -> bool:
    """`loss` (finite) stands out of `others` (finite losses of the step's other samples) by the module's rule."""
    if not _finite(loss) or len(others) < MIN_OTHERS:
        return False
    median = statistics.median(others)
    mad = statistics.median(abs(v - median) for v in others)
    floor = max(mad, 1e-3 * abs(median), 1e-12)  # identical losses (a tiny or saturated model) have MAD 0
    return loss >= LOSS_OUTLIER_RATIO * median and loss - median > LOSS_OUTLIER_MADS * floor


def weigh(
    culprits: list[SampleRef],
    rows: list[dict],
    facts: dict[SampleRef, list[SampleFact]],
    *,
    nonfinite_trigger: bool,
    full_precision: bool,
    isolated: bool,
    others_far: Callable[[], bool] = lambda: True,
    healthy_ceiling: float | None = None,
) -> RecordEvidence:
    """The evidence about the culprits' records from what the replay measured.

    Args:
        culprits: the samples bisection (or the data) named.
        rows: the per-sample table (each sample replayed alone: sample_id, micro_batch, index, loss, grad_norm).
        facts: what is odd in each culprit's own data (replay/culprits/sample_facts.py).
        nonfinite_trigger: the trigger is a NaN/Inf (not a spike).
        full_precision: the step was (also) replayed in float32 and still failed as recorded: an fp32 job, or the
            fp32 re-run checked to have run in float32 (replay/judge/precision.py).
        isolated: bisection's test was isolation (the culprits fail on their own), not removal.
        others_far: whether the step without the culprits stays far from its dtypes' limits (asked only when it
            decides: forensics.replay.culprits.margin.others_share); a sample that alone goes non-finite counts against its
            record only then — on a state where everyone is near the limit, it only crossed first.
        healthy_ceiling: the top of the run's recorded healthy loss range (the history's, None: no history); a loss
            is an outlier only against others within it (`unhealthy_baseline`).
    """
    evidence = RecordEvidence()
    chosen = set(culprits)
    by_ref = {(r.get("micro_batch"), r.get("index")): r for r in rows if isinstance(r, dict)}
    other_rows = [r for key, r in by_ref.items() if not any((c.micro_batch, c.index) == key for c in chosen)]
    other_losses = [r["loss"] for r in other_rows if _finite(r.get("loss"))]
    other_norms = [r["grad_norm"] for r in other_rows if _finite(r.get("grad_norm"))]
    all_others_finite = bool(other_rows) and len(other_losses) == len(other_rows)
    unhealthy = unhealthy_baseline([r.get("loss") for r in other_rows], healthy_ceiling)
    described = []
    for ref in culprits:
        for fact in facts.get(ref, []):
            evidence.against.append(Evidence(EvidenceKind.RECORD_DATA, ref.sample_id, fact.words))
        row = by_ref.get((ref.micro_batch, ref.index)) or {}
        loss, norm = row.get("loss"), row.get("grad_norm")
        if loss_outlier(loss, other_losses) and unhealthy is not None:
            evidence.set_aside.append(
                f"sample {fmt_id(ref.sample_id, 80)}: its loss alone {fmt_num(loss, 3)} against a median of "
                f"{fmt_num(statistics.median(other_losses), 3)} for the others is no evidence: {unhealthy}"
            )
        elif loss_outlier(loss, other_losses):
            evidence.against.append(
                Evidence(
                    EvidenceKind.LOSS_OUTLIER,
                    ref.sample_id,
                    f"its loss replayed alone is {fmt_num(loss, 4)}, against {_range(other_losses)} for the other "
                    f"{len(other_losses)} samples (median {fmt_num(statistics.median(other_losses), 4)})",
                )
            )
        elif (
            nonfinite_trigger
            and full_precision
            and isolated
            and row
            and not _finite(loss)
            and all_others_finite
            and others_far()
        ):
            evidence.against.append(
                Evidence(
                    EvidenceKind.NONFINITE_ALONE,
                    ref.sample_id,
                    f"on its own it makes the loss non-finite in float32 too, while each of the other "
                    f"{len(other_losses)} samples alone gives a finite loss ({_range(other_losses)}) and the step "
                    "without it stays far from float32's limit",
                )
            )
        if _finite(loss) and other_losses:
            part = f"its loss {fmt_num(loss, 4)} against {_range(other_losses)} for the other {len(other_losses)}"
            if _finite(norm) and other_norms:
                part += f"; its gradient norm {fmt_num(norm, 3)} against {_range(other_norms)}"
            described.append(part)
    if described:
        evidence.ordinary = "; ".join(described[:2])
    return evidence


__all__ = [
    "Evidence",
    "RecordEvidence",
    "loss_outlier",
    "unhealthy_baseline",
    "weigh",
    "LOSS_OUTLIER_RATIO",
    "LOSS_OUTLIER_MADS",
]
