"""The culprit stage of a replay: which samples make the step fail, and whether the low precision does.

`find_culprits` records the samples found — a size that stands out (out of memory), samples longer than the
model's context, bisection over the samples, or the batch field that is non-finite itself — and what is odd in
their own data. `weigh_precision` re-runs them in fp32 and, when the step fails only in low precision, measures how
close the rest of the step comes to fp16's limit without them (the `margin`). Neither blames anyone: whether the
samples found are blamed is the verdict's (replay/judge/verdict.blamed_samples).
"""

from __future__ import annotations

from forensics.core.errors import is_out_of_memory
from forensics.core.kinds import Phase, TriggerKind
from forensics.replay.culprits.margin import others_margin
from forensics.replay.culprits.sample_facts import describe_samples, nonfinite_in_field, too_long
from forensics.replay.culprits.sizes import longer_than, outlier_refs, size_summary
from forensics.replay.judge.findings import Findings
from forensics.replay.judge.precision import fp32_check, uses_low_precision
from forensics.replay.run.execute import SampleRef, StepRunner
from forensics.replay.options import ReplayOptions
from forensics.replay.stages import Progress, bisect_samples, input_field, stage


def find_culprits(findings: Findings, runner: StepRunner, options: ReplayOptions, progress: Progress | None) -> None:
    """The samples that make the step fail, into `findings.bisection` (and what is odd in each, `sample_facts`)."""
    session = runner.session
    refs = session.sample_refs
    raised = findings.kind is TriggerKind.EXCEPTION
    data_independent = (
        findings.kind.data_independent
        or bool(findings.weights_nonfinite)
        or findings.phase is Phase.OPTIMIZER
        or findings.norm_overflow is not None
    )
    largest: list[SampleRef] = []
    if raised and is_out_of_memory((session.exception or {}).get("type"), (session.exception or {}).get("message")):
        stage(progress, "measuring the samples' sizes (out of memory)")
        findings.sizes = size_summary(session.micro_batches, refs)
        largest = outlier_refs(findings.sizes, refs)
    elif raised and findings.exception is not None and findings.exception.context_limit:
        longer = longer_than(session.micro_batches, refs, findings.exception.context_limit)
        largest = [s.ref for s in longer]
        findings.sample_facts = {s.ref: [too_long(s.tokens, findings.exception.context_limit)] for s in longer}
    if largest:  # padding makes its micro-batch fail whichever of its samples run: the size names the culprit
        findings.bisection.culprits = largest
    elif findings.reproduced and options.bisect and not data_independent and refs:
        stage(progress, f"bisecting {len(refs)} samples")
        findings.bisection = bisect_samples(runner, refs, findings.kind, findings.threshold, options)
    elif findings.reproduced and not data_independent and (in_batch := input_field(findings.forward)) is not None:
        # the first non-finite value is in the batch itself: its samples holding it are named without bisection
        mb, name = in_batch
        findings.bisection.culprits = nonfinite_in_field(
            session.micro_batches[mb], [r for r in refs if r.micro_batch == mb], name
        )
    findings.sample_facts = {**describe_samples(session.micro_batches, findings.culprits), **findings.sample_facts}


def weigh_precision(findings: Findings, runner: StepRunner, options: ReplayOptions, progress: Progress | None) -> None:
    """The fp32 triage (`findings.precision`: the culprits re-run in fp32, or only the dtypes where a re-run says
    nothing) and, for a step that fails only in low precision with samples found, the fp16 margin without them
    (`findings.margin`)."""
    if findings.kind is TriggerKind.EXCEPTION:
        pass
    elif options.fp32_check and findings.reproduced and findings.weights_nonfinite:
        findings.precision = fp32_check(runner, kind=TriggerKind.NONFINITE_PARAM)  # broken weights fail in any dtype:
        # a re-run on them says nothing about the precision (dtype facts only)
    elif options.fp32_check and findings.reproduced:
        if uses_low_precision(runner):
            stage(progress, "re-running in fp32")
        findings.precision = fp32_check(
            runner, findings.culprits or None, kind=findings.kind, threshold=findings.threshold
        )
    elif options.fp32_check:
        findings.precision = fp32_check(runner, kind=TriggerKind.NONFINITE_PARAM)  # dtype facts only, no run
    if findings.culprits and findings.precision is not None and findings.precision.get("fp32_reproduces") is False:
        stage(progress, "measuring how close the other samples come to fp16's limit")
        findings.margin = others_margin(runner, findings.culprits)  # whether they are blamed is the verdict's


__all__ = ["find_culprits", "weigh_precision"]
