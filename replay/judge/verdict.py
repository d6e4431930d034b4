"""Turn what the replay found into the report's verdict: kind, headline, explanation, suggestions.

`decide_verdict(VerdictFacts(...), VerdictContext(...))` is the one function that returns a replayed step's verdict:
it applies the rules below in order (`_by_rule`; the first that holds wins, and its builder, in verdict_state.py or
verdict_data.py, words it and only words it), puts the tested remedies around its suggestions
(`suggestions_with_remedies`), and words what the context hands it (verdict_context.in_context: the window replay's
step that broke and its start, a host snapshot it could not use, the history and earlier dumps before the crash).
Nothing edits a verdict after it returns (tests/test_architecture.py). Every return is a row:

| rule (in order; the first that holds)                                          | builder               | kind                    |
|--------------------------------------------------------------------------------|-----------------------|-------------------------|
| not reproduced, and the trigger came from another rank (`local: false`)        | `inherited`           | `not_reproduced`        |
| not reproduced, and the job ran out of memory (a device with less memory)      | `memory_not_reproduced` | `not_reproduced`      |
| not reproduced, and recorded / replayed is a factor the job recorded (units)   | `other_units`         | `not_reproduced`        |
| a non-finite grad norm replayed finite, but the step diverges here as in the run, every sample alone too (finite loss, norm past the bar in the step's units), a healthy norm of 3+ steps or an earlier state, and no sample failing on the earlier state when one ran (`diverged_here`) | `diverged_elsewhere` | `model_state` |
| the replay did not fail                                                        | `not_reproduced`      | `not_reproduced`        |
| the step raised out of memory, and a sample is far larger than the others     | `oversized`           | `exception`             |
| the step raised                                                                | `exception_verdict`   | `exception`             |
| a spike whose own update wrecks the weights (window replay), no culprit subset | `update_too_large`    | `spike_no_single_cause` |
| a spike in a run that diverged long before (or whose loss pattern diverged)    | `diverged`            | `spike_no_single_cause` |
| every gradient finite, their norm overflows                                    | `norm_overflow`       | `model_state`           |
| weights non-finite before the step                                             | `model_state`         | `model_state`           |
| every subset fails, not a precision failure, and the failure needs the dump's RNG | `rng_dependent`    | `model_state`           |
| every subset fails, and not a precision failure                                | `model_state`         | `model_state`           |
| forward and backward finite, the optimizer update broke a weight              | `optimizer_update`    | `optimizer_update`      |
| finite in fp32, non-finite in float16 / bfloat16 (and fp32 not refuted as a fix) | `numerical_precision` | `numerical_precision` |
| a culprit subset, and evidence that its record is bad                          | `bad_sample`          | `bad_sample`            |
| not a spike nor the whole batch, in a run that diverged or whose loss grew geometrically | `diverging`  | `model_state`           |
| a culprit subset, and nothing shows its record is bad                          | `trigger_sample`      | `trigger_sample`        |
| a spike (finite trigger) with no culprit subset                                | `spike`               | `spike_no_single_cause` |
| anything else, and the failure needs the dump's RNG                            | `rng_dependent`       | `model_state`           |
| anything else (non-finite, but only the whole batch fails)                     | `model_state`         | `model_state`           |

The dumps with no step to replay get the one kind their trigger fixes, decided and worded by one function each and
never edited after: `instability_ahead` for a precursor dump and `exception_between_steps` for a step that raised
between steps (verdict_unreplayed.py), `silent_verdict` for a silent-corruption dump (verdict_silent.py, its own
table of rules for the class).

The samples bisection found are blamed unless (`withheld`, the one rule for it; `blamed_samples` applies it to the
replay's findings, and the report's `culprit.samples` lists only the samples blamed, its `bisection` block what was
found):

| found samples, but                                                                 | blamed |
|------------------------------------------------------------------------------------|--------|
| the step fails only in fp16, and without them the rest still reaches HEADROOM of fp16's max (`margin`) | none: the state is at the edge |
| the trigger is a spike, and the run diverged long before (`history.diverged`)      | none: the spike is that run's symptom |

The blamed samples are named as triggers, the first to cross and not bad data (`marks_triggers`: report
`culprit.samples[].trigger`, never in a blocklist), when their records were examined and nothing was found against
them; and the remedies the replay tested go around the verdict's own suggestions (`suggestions_with_remedies`: a fix
that worked first). replay/judge/assemble.py places both in the report; it decides neither.

Evidence that a record is bad (replay/culprits/evidence.py): its data is odd on its own, its loss alone is an outlier,
it alone makes the loss non-finite in float32, or it still fails on an earlier state. Without any, the sample only
crossed first (`trigger_sample`): no blocklist, no "filter", and the advice is about the state.

Evidence never stands beside a finding of the same replay that contradicts it (`refutations`, applied before any
rule; issue 50): then it counts for nothing, the samples are named as triggers, and the verdict says why —

| the replay also found                                                          | so the records are not the cause  |
|--------------------------------------------------------------------------------|-----------------------------------|
| fed to an earlier state, the culprits are healthy (PaLM's test)                | the state fails, not the data     |
| remedy "drop the culprit samples": not enough (the step fails without them)    | filtering them does not help      |
| other samples, outside the culprits, are non-finite on their own too           | any sample fails on this state    |
| the failure needs the dump's RNG (healthy from other seeds)                    | a random draw, not the record     |

Likewise a precision verdict does not stand beside the remedy "run the step in fp32: not enough" in a run whose
loss grew geometrically (`fp32_fix_fails`): the divergence is the cause, the format only where it crossed. The fp32 re-run counts
only when it was checked to have run in float32 (replay/run/fp32.py).

The wording follows what a practitioner's forensic answer gives ("step, rank, micro-batch; reproduced; the first
non-finite layer and op; the culprit and how it was found; fp32 or not"): the headline is one sentence naming what broke and where; the explanation gives the evidence in the
triage order (where, reproduction, culprit, precision, history); suggestions are concrete.
"""

from __future__ import annotations

import dataclasses

from forensics.core.kinds import HistoryPattern, Phase, RemedyKind, TriggerKind, VerdictKind
from forensics.report.tree import Verdict
from forensics.replay.judge.findings import Findings
from forensics.replay.judge.verdict_context import NO_CONTEXT, VerdictContext, in_context
from forensics.replay.judge.remedies import tested_suggestions
from forensics.replay.run.execute import SampleRef
from forensics.replay.judge.verdict_data import (
    bad_sample,
    exception_verdict,
    numerical_precision,
    oversized,
    trigger_sample,
)
from forensics.replay.judge.verdict_facts import (
    MAX_NAMED_SAMPLES,
    VerdictFacts,
    diverged_here,
    has_culprit,
    low_precision,
    whole_batch,
)
from forensics.replay.judge.verdict_words import quoted_id
from forensics.replay.judge.verdict_state import (
    diverged,
    diverged_elsewhere,
    diverging,
    inherited,
    memory_not_reproduced,
    model_state,
    norm_overflow,
    not_reproduced,
    optimizer_update,
    other_units,
    rng_dependent,
    spike,
    update_too_large,
)


def withheld(spike: bool | None, edge_share: float | None, run_diverged: str | None) -> str | None:
    """Why the samples bisection found are not blamed (the second table of the module docstring); None: they are.

    Args:
        spike: the trigger is a finite spike.
        edge_share: the fp16 margin, when the state is at the edge (VerdictFacts.edge_share); None otherwise.
        run_diverged: the sentence saying the run diverged long before (VerdictFacts.run_diverged), or None.
    """
    if edge_share is not None:
        return "the state is at the edge of fp16: whichever sample crosses first is not to blame"
    if spike and run_diverged:
        return "the run diverged long before: the samples whose removal ends the spike are not culprits"
    return None


def refutations(f: VerdictFacts) -> list[str]:
    """The replay's own findings that contradict calling the culprits bad data (the module docstring's last table),
    in words; empty when nothing contradicts the evidence (or there is no evidence to contradict).

    Example:
        >>> refutations(VerdictFacts("nonfinite_loss", True, culprit_samples=[48], candidates=8,
        ...                          record_evidence=["its loss alone is 3.7e+14"], rng_dependent=True))
        ["the failure needs the dump's RNG: from other seeds the same step is healthy"]
    """
    if not has_culprit(f) or not f.record_evidence:
        return []
    out = []
    if f.earlier_state_healthy:
        out.append("fed to an earlier state, the culprit is healthy: the state fails, not the record")
    if f.remedies.get(RemedyKind.DROP_SAMPLES.value) is False:
        out.append(
            "without the culprits the step is not healthy either (remedy 'drop the culprit samples': not enough)"
        )
    others = [s for s in (f.samples_failing or []) if s not in f.culprit_samples]
    if others:
        named = ", ".join(quoted_id(s) for s in others[:MAX_NAMED_SAMPLES])
        more = f" and {len(others) - MAX_NAMED_SAMPLES} more" if len(others) > MAX_NAMED_SAMPLES else ""
        were = "is" if len(others) == 1 else "are"
        out.append(
            f"{len(others)} other sample{'s' if len(others) != 1 else ''} ({named}{more}) {were} non-finite on its own too"
        )
    if f.rng_dependent:
        out.append("the failure needs the dump's RNG: from other seeds the same step is healthy")
    return out


def fp32_fix_fails(f: VerdictFacts) -> bool:
    """The step is finite in fp32, but running it in fp32 was tried as a fix and was not enough (the update still
    wrecks the weights) in a run whose loss grew geometrically: the precision is where it crossed, not why — a precision
    verdict would stand beside the remedy row that refutes it (issue 50). The divergence rules speak instead."""
    # exponential growth only (the field notes' "learning rate too high"): a loss that sits far above its start while
    # the activations climb toward fp16's limit (tests/natural "output_logits") is the format's to name
    growing = f.history_pattern is HistoryPattern.EXPONENTIAL_GROWTH
    return f.remedies.get(RemedyKind.FP32.value) is False and growing


def blamed_samples(findings: Findings) -> list[SampleRef]:
    """The samples the verdict blames, of those bisection (or the sizes, or the batch's own non-finite field) found:
    all of them, or none where `withheld` says so. The stages that act on blamed samples only (the per-sample rows
    they are sure to get, the remedy that drops them, the evidence against their records, the earlier state they
    are fed to) ask it with what is known when they run; the report asks it once everything is."""
    margin = findings.margin
    edge = margin["share"] if margin is not None and margin["at_the_edge"] else None
    if withheld(findings.kind.spike, edge, findings.history.diverged):
        return []
    return list(findings.culprits)


def marks_triggers(verdict: Verdict, findings: Findings) -> bool:
    """Whether the samples the verdict blames are named as the first to cross, not as bad data (the report's
    `culprit.samples[].trigger`; no blocklist lists them): their records were examined and nothing is against them,
    or what was is refuted (`refutations`: replay/judge/assemble.py writes them into the evidence first).
    Never for a step that raised (`exception`): its samples are named by what the exception says of them."""
    evidence = findings.evidence
    return verdict.kind != VerdictKind.EXCEPTION and evidence is not None and not evidence.bad_data


def suggestions_with_remedies(kind: VerdictKind, suggestions: list | None, facts: VerdictFacts) -> list | None:
    """A verdict's suggestions with what the replay's remedies showed (`facts.tested_remedies`; replay/judge/
    remedies.tested_suggestions): a fix that made the step healthy leads, skipping the step (or a harmless update) is
    said after; without tested remedies, the verdict's own. Which of those lines apply follows the verdict's `kind`:
    the run diverged (no "no action needed"), it blames the data (bad_sample, exception, or a precision verdict with
    evidence against the record), it names a trigger."""
    if not facts.tested_remedies:
        return suggestions
    diverged = bool(facts.run_diverged) or facts.history_pattern is HistoryPattern.DIVERGED
    blames = kind in (VerdictKind.BAD_SAMPLE, VerdictKind.EXCEPTION) or (
        kind == VerdictKind.NUMERICAL_PRECISION and facts.evidence_bad_data
    )
    first, last = tested_suggestions(
        facts.tested_remedies, diverged=diverged, blames_data=blames, trigger=kind == VerdictKind.TRIGGER_SAMPLE
    )
    return list(dict.fromkeys(first + (suggestions or []) + last))


def decide_verdict(facts: VerdictFacts, context: VerdictContext = NO_CONTEXT) -> Verdict:
    """The report's `verdict` section, decided and worded once (rules in the module docstring): the rule's verdict,
    its suggestions around what the remedies showed (`suggestions_with_remedies`), and what `context` adds
    (replay/judge/verdict_context.in_context: the window replay, the host snapshot, the history before the crash).

    Args:
        facts: what the replay established.
        context: what is known around the replayed step (default: nothing).
    Returns:
        The verdict: its kind (a forensics.core.kinds.VerdictKind), headline, explanation and suggestions.
    Example:
        >>> v = decide_verdict(VerdictFacts("nonfinite_loss", True, step=41217, rank=3,
        ...                                 culprit_samples=["shard-0192/rec-55411"], candidates=32,
        ...                                 bisect_runs=6, phase="forward",
        ...                                 module="model.layers.17.mlp.down_proj", op="aten::mm"))
        >>> v.kind.value, v.headline
        ('bad_sample', "Sample 'shard-0192/rec-55411' alone makes the loss non-finite at step 41217 (rank 3) in the forward pass at `model.layers.17.mlp.down_proj` (aten::mm).")
    """
    ruled = _by_rule(facts)
    suggestions = suggestions_with_remedies(ruled.kind, ruled.suggestions, facts)  # type: ignore[arg-type]
    if suggestions is not ruled.suggestions:
        ruled = dataclasses.replace(ruled, suggestions=suggestions)
    return in_context(ruled, context)


def _by_rule(facts: VerdictFacts) -> Verdict:
    """The first rule of the module docstring's table that holds, worded by its builder."""
    f = facts
    if f.culprit_samples and withheld(f.spike, f.edge_share, f.run_diverged):
        f = _unblamed(f)
    if refuted := refutations(f):
        f = _refuted(f, refuted)
    if not f.reproduced and not f.trigger_local:
        return inherited(f)
    if not f.reproduced and f.out_of_memory:
        return memory_not_reproduced(f)
    if not f.reproduced and f.unit_factor:
        return other_units(f)
    if (divergence := diverged_here(f)) is not None:
        return diverged_elsewhere(f, divergence)
    if not f.reproduced:
        return not_reproduced(f)
    if f.trigger_kind is TriggerKind.EXCEPTION and f.out_of_memory and f.size_outliers:
        return oversized(f)
    if f.trigger_kind is TriggerKind.EXCEPTION:
        return exception_verdict(f)
    if f.spike and f.update_change is not None and not has_culprit(f):
        return update_too_large(f)
    if f.spike and (f.run_diverged or f.history_pattern is HistoryPattern.DIVERGED):
        return diverged(f)
    precision = (
        f.fp32_reproduces is False
        and (low_precision(f) is not None or f.fp32_ran is not None)
        and not fp32_fix_fails(f)
    )
    if f.grad_norm_overflow is not None and not f.weights_nonfinite_at_start:
        return norm_overflow(f)
    if f.weights_nonfinite_at_start:
        return model_state(f)
    if f.all_subsets_fail and not precision and f.rng_dependent:
        return rng_dependent(f)
    if f.all_subsets_fail and not precision:
        return model_state(f)
    if f.phase is Phase.OPTIMIZER:
        return optimizer_update(f)
    if precision:  # every sample failing alone, or none to blame, and finite in fp32: the precision is the cause
        return numerical_precision(f)
    if has_culprit(f) and f.record_evidence:
        return bad_sample(f)
    if (
        not f.spike
        and not whole_batch(f)
        and (f.run_diverged or f.history_pattern in (HistoryPattern.EXPONENTIAL_GROWTH, HistoryPattern.DIVERGED))
    ):
        return diverging(f)  # a NaN at the end of a loss that grew for steps: the learning rate, whoever crossed
    if has_culprit(f):
        return trigger_sample(f)
    if f.spike:
        return spike(f)
    if f.rng_dependent:
        return rng_dependent(f)
    return model_state(f)


def _refuted(f: VerdictFacts, refuted: list[str]) -> VerdictFacts:
    """`f` with the evidence against the culprits' records set aside, and why (`refuted`): the rules then decide as for
    samples against which nothing was found (a trigger, a diverged run, the state)."""
    return dataclasses.replace(
        f,
        record_evidence=[],
        culprit_facts=[],
        evidence_set_aside=[*f.evidence_set_aside, *f.record_evidence],
        refuted_by=refuted,
    )


def _unblamed(f: VerdictFacts) -> VerdictFacts:
    """`f` with the samples found but not blamed left out: what the verdict decides on is then the step without a
    culprit (the report's `bisection` block still says what was found)."""
    return dataclasses.replace(
        f,
        culprit_samples=[],
        culprit_facts=[],
        culprit_subset_size=0,
        record_evidence=[],
        ordinary_record=None,
        earlier_state=None,
        earlier_state_healthy=None,
        evidence_set_aside=[],
    )


__all__ = [
    "VerdictContext",
    "VerdictFacts",
    "blamed_samples",
    "decide_verdict",
    "fp32_fix_fails",
    "marks_triggers",
    "refutations",
    "suggestions_with_remedies",
    "withheld",
]
