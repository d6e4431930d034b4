"""Turn what the replay found into the report's verdict: kind, headline, explanation, suggestions.

`decide_verdict(VerdictFacts(...))` applies the rules below in order; the first that holds wins.

| rule                                                              | kind                    |
|-------------------------------------------------------------------|-------------------------|
| the replay did not fail                                           | `not_reproduced`        |
| weights non-finite before the step, or every sample fails alone   | `model_state`           |
| forward and backward finite, the optimizer update broke a weight  | `optimizer_update`      |
| finite in fp32, non-finite in float16 / bfloat16                  | `numerical_precision`   |
| a culprit subset, and evidence that its record is bad             | `bad_sample`            |
| a culprit subset, and nothing shows its record is bad             | `trigger_sample`        |
| a spike (finite trigger) with no culprit subset                   | `spike_no_single_cause` |
| anything else (non-finite, but only the whole batch fails)        | `model_state`           |

Before the weight / precision / sample rules, a spike whose own update wrecks the weights (window replay) or in a
run whose loss had long left where it started is `spike_no_single_cause` with no sample named; a step whose
gradients are all finite but whose norm overflows (a divergence) is `model_state`.
Evidence that a record is bad (replay/culprits/evidence.py): its data is odd on its own, its loss alone is an outlier,
it alone makes the loss non-finite in float32, or it still fails on an earlier state. Without any, the sample only
crossed first (`trigger_sample`): no blocklist, no "filter", and the advice is about the state. The fp32 re-run counts
only when it was checked to have run in float32 (replay/run/fp32.py).

The wording follows the field notes' "What a good forensic answer looks like" (../shared/FIELD-NOTES.md): the
headline is one sentence naming what broke and where; the explanation gives the evidence in the
triage order (where, reproduction, culprit, precision, history); suggestions are concrete.
"""

from __future__ import annotations

from forensics.core.kinds import HistoryPattern, Phase, TriggerKind
from forensics.replay.judge.verdict_data import bad_sample, exception_verdict, numerical_precision, trigger_sample
from forensics.replay.judge.verdict_facts import VerdictFacts, has_culprit, low_precision, whole_batch
from forensics.replay.judge.verdict_state import (
    diverged,
    diverging,
    inherited,
    model_state,
    norm_overflow,
    not_reproduced,
    optimizer_update,
    spike,
    update_too_large,
)


def decide_verdict(facts: VerdictFacts) -> dict:
    """The report's `verdict` section from the replay's findings (rules in the module docstring).

    Args:
        facts: what the replay established.
    Returns:
        `{"kind", "headline", "explanation", "suggestions"}` with kind a forensics.core.kinds.VerdictKind value.
    Example:
        >>> v = decide_verdict(VerdictFacts("nonfinite_loss", True, step=41217, rank=3,
        ...                                 culprit_samples=["shard-0192/rec-55411"], candidates=32,
        ...                                 bisect_runs=6, phase="forward",
        ...                                 module="model.layers.17.mlp.down_proj", op="aten::mm"))
        >>> v["kind"], v["headline"]
        ('bad_sample', "Sample 'shard-0192/rec-55411' alone makes the loss non-finite at step 41217 (rank 3) in the forward pass at `model.layers.17.mlp.down_proj` (aten::mm).")
    """
    f = facts
    if not f.reproduced and not f.trigger_local:
        return inherited(f)
    if not f.reproduced:
        return not_reproduced(f)
    if f.trigger_kind is TriggerKind.EXCEPTION:
        return exception_verdict(f)
    if f.spike and f.update_change is not None and not has_culprit(f):
        return update_too_large(f)
    if f.spike and (f.run_diverged or f.history_pattern is HistoryPattern.DIVERGED):
        return diverged(f)
    precision = f.fp32_reproduces is False and (low_precision(f) is not None or f.fp32_ran is not None)
    if f.grad_norm_overflow is not None and not f.weights_nonfinite_at_start:
        return norm_overflow(f)
    if f.weights_nonfinite_at_start or (f.all_subsets_fail and not precision):
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
    return model_state(f)


__all__ = ["VerdictFacts", "decide_verdict"]
