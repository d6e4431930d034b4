"""No record is bad data on evidence the report itself refutes (issue 50, item 1).

A GPT-2 at a learning rate far too high was replayed as `bad_sample` with a blocklist on the sole evidence that one
sample's loss (3.7e14) stood out against the others' (median 1.7e14), while the same report said the sample was healthy
on an earlier state, that dropping the culprits was not enough, that other samples were non-finite alone too and that
the failure needed the dump's RNG. Here: the loss-outlier rule holds only against a healthy baseline, the earlier
state overrules it, and the verdict rules set evidence aside whenever one of those findings contradicts it (one test
per conflict; the planted case without a conflict stays `bad_sample`)."""

from __future__ import annotations

import dataclasses

import pytest

from forensics.core.kinds import EvidenceKind, HistoryPattern, RemedyKind, VerdictKind
from forensics.replay.culprits.evidence import weigh
from forensics.replay.judge.verdict import VerdictFacts, decide_verdict, refutations
from forensics.replay.run.execute import SampleRef

CULPRIT = SampleRef(0, 3, 48)


def _rows(culprit_loss: float, others: list[float]) -> list[dict]:
    rows = [{"sample_id": 48, "micro_batch": 0, "index": 3, "loss": culprit_loss, "grad_norm": 1.0}]
    for i, loss in enumerate(others):
        index = i if i < 3 else i + 1
        rows.append({"sample_id": 100 + i, "micro_batch": 0, "index": index, "loss": loss, "grad_norm": 1.0})
    return rows


def _weigh(culprit_loss: float, others: list[float], ceiling: float | None):
    return weigh(
        [CULPRIT],
        _rows(culprit_loss, others),
        {},
        nonfinite_trigger=True,
        full_precision=False,
        isolated=False,
        healthy_ceiling=ceiling,
    )


HEALTHY = [4.1, 4.2, 4.15, 4.3, 4.0, 4.25, 4.12]


def test_a_loss_far_above_healthy_others_is_still_evidence():
    """The planted case (a mislabeled record against a healthy step) keeps its evidence."""
    evidence = _weigh(40.0, HEALTHY, ceiling=6.2)
    assert [e.kind for e in evidence.against] == [EvidenceKind.LOSS_OUTLIER]


def test_a_loss_outlier_on_a_diverged_state_is_no_evidence():
    """1e14 against 1e14: every loss of the step is far outside the run's recorded range (healthy steps up to 6.2)."""
    others = [1.7e14, 1.2e14, 1.9e14, 1.6e14, 1.8e14, 1.5e14, 1.7e14]
    evidence = _weigh(3.7e14, others, ceiling=6.2)
    assert evidence.against == [] and not evidence.bad_data
    assert "far outside the run's recorded range" in evidence.set_aside[0]
    assert evidence.as_dict()["set_aside"] == evidence.set_aside


def test_a_loss_outlier_beside_others_non_finite_alone_is_no_evidence():
    """Other samples non-finite on their own: the finite rest is no baseline (even without a history)."""
    others = [1.7e14, float("nan"), 1.9e14, float("nan"), 1.8e14, float("nan"), 1.7e14]
    evidence = _weigh(3.7e14, others, ceiling=None)
    assert evidence.against == []
    assert "3 of the other 7 samples are non-finite alone too" in evidence.set_aside[0]


def test_healthy_on_an_earlier_state_overrules_a_loss_outlier():
    evidence = _weigh(40.0, HEALTHY, ceiling=6.2)
    evidence.clear_by_earlier_state()
    assert evidence.against == [] and evidence.earlier_healthy is True
    assert "overruled" in evidence.set_aside[0]


# --- the verdict rules: a verdict cannot stand beside a finding that contradicts it ---

BLAMED = VerdictFacts(
    "nonfinite_loss",
    True,
    step=7,
    rank=0,
    culprit_samples=[46, 48, 3, 27],
    candidates=8,
    bisect_runs=9,
    record_evidence=["its loss replayed alone is 3.7e+14, against 1.2e+14-1.9e+14 for the other 4 samples"],
    samples_failing=[],
    samples_checked=8,
    remedies={RemedyKind.DROP_SAMPLES.value: True, RemedyKind.SKIP_STEP.value: True},
    rng_dependent=False,
)


def test_without_a_conflict_the_evidence_makes_bad_sample():
    """The control: the same facts with nothing contradicting them blame the data."""
    assert refutations(BLAMED) == []
    assert decide_verdict(BLAMED).kind == VerdictKind.BAD_SAMPLE


CONFLICTS = {
    "earlier_state": dict(earlier_state_healthy=True),
    "drop_remedy": dict(remedies={RemedyKind.DROP_SAMPLES.value: False, RemedyKind.SKIP_STEP.value: True}),
    "others_fail_alone": dict(samples_failing=[1, 5, 9]),
    "rng": dict(rng_dependent=True, rng_seeds_tried=3),
}


@pytest.mark.parametrize("conflict", sorted(CONFLICTS))
def test_a_finding_that_contradicts_the_evidence_sets_it_aside(conflict):
    facts = dataclasses.replace(BLAMED, **CONFLICTS[conflict])
    verdict = decide_verdict(facts)
    assert verdict.kind != VerdictKind.BAD_SAMPLE, verdict.headline
    assert len(refutations(facts)) == 1
    text = verdict.headline + " " + verdict.explanation + " " + " ".join(verdict.suggestions)
    assert "Filter" not in text and "blocklist.jsonl lists" not in text, text
    assert "does not hold" in verdict.explanation  # the report says why the evidence was set aside


def test_in_a_run_that_grew_exponentially_the_refuted_culprits_leave_a_state_verdict():
    """The issue's run: exponential growth at lr 18, the culprits healthy on an earlier state → model_state."""
    facts = dataclasses.replace(
        BLAMED,
        earlier_state_healthy=True,
        history_pattern=HistoryPattern.EXPONENTIAL_GROWTH,
        lr=18.0,
        samples_failing=[1, 5, 9],
        rng_dependent=True,
    )
    verdict = decide_verdict(facts)
    assert verdict.kind == VerdictKind.MODEL_STATE, verdict.headline
    assert "no sample is to blame" in verdict.headline and "learning rate of 18" in verdict.headline


def test_a_precision_verdict_does_not_stand_beside_a_failed_fp32_fix_in_a_diverging_run():
    """Finite in fp32, but 'run the step in fp32' was tried and was not enough, and the loss grew for steps: the
    divergence is the cause (the precision only where it crossed)."""
    facts = VerdictFacts(
        "nonfinite_grad",
        True,
        step=6,
        rank=0,
        candidates=8,
        fp32_reproduces=False,
        autocast_dtype="bfloat16",
        history_pattern=HistoryPattern.EXPONENTIAL_GROWTH,
        lr=18.0,
        remedies={RemedyKind.FP32.value: False, RemedyKind.SKIP_STEP.value: True},
    )
    assert decide_verdict(dataclasses.replace(facts, remedies={})).kind == VerdictKind.NUMERICAL_PRECISION  # control
    verdict = decide_verdict(facts)
    assert verdict.kind == VerdictKind.MODEL_STATE and "learning rate of 18" in verdict.headline, verdict.headline
