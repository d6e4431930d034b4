"""The replay's stages on a ready ReplaySession, in order, on one step runner: reproduce → localise → culprits →
precision → weights → per-sample → history → remedies → evidence, then the report (replay/judge/assemble.py).

`run_session` is the public entry for a session built in memory; `session_report` is what engine.py and a window
replay (replay/window_report.py) call. Each stage records what it found in the Findings; the verdict decides what
it means (replay/judge/verdict.py), including which of the samples found it blames.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from forensics.core.kinds import TriggerKind
from forensics.report.tree import Report
from forensics.replay.culprit_stage import find_culprits, weigh_precision
from forensics.replay.culprits.earlier_state import EarlierState, feed_earlier_state, rows_on_earlier_state
from forensics.replay.judge.assemble import assemble_report
from forensics.replay.judge.findings import Findings
from forensics.replay.judge.remedies import try_remedies
from forensics.replay.judge.remedy_followup import follow_remedies
from forensics.replay.judge.verdict import blamed_samples
from forensics.replay.judge.verdict_facts import DIVERGED_TIMES_HEALTHY
from forensics.replay.judge.verdict_context import NO_CONTEXT, VerdictContext
from forensics.replay.load.session import ReplaySession
from forensics.replay.localize.exception import localize_exception
from forensics.replay.localize.update import per_layer_stats
from forensics.replay.localize.weights import corrupted_weights, samples_touching_embeddings
from forensics.replay.options import ReplayOptions
from forensics.replay.run.execute import SampleRef, StepRunner
from forensics.replay.run.streamed_runner import StreamedStepRunner, expected_passes, runner_for
from forensics.replay.run.units import unscaled_history
from forensics.replay.stages import (
    Progress,
    history_finding,
    largest_gradient,
    localise,
    per_sample_rows,
    reproduce_step,
    stage,
    uniform_loss,
    weigh_evidence,
)


def run_session(
    session: ReplaySession,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    *,
    dump_info: dict | None = None,
    history: dict | None = None,
    started: float | None = None,
    earlier: EarlierState | None = None,
) -> dict:
    """The replay pipeline on a ready ReplaySession (in-memory replays and tests; run_replay calls it).

    `earlier`: an earlier state of the model to feed the culprits to (replay/culprits/earlier_state.py).
    Returns:
        The report dict (see forensics.replay.engine.run_replay).
    """
    return session_report(
        session,
        options,
        progress,
        dump_info=dump_info,
        history=history,
        started=started,
        earlier=(lambda: earlier) if earlier is not None else None,
    ).as_dict()


def session_report(
    session: ReplaySession,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    *,
    dump_info: dict | None = None,
    history: dict | None = None,
    started: float | None = None,
    earlier: Callable[[], EarlierState] | None = None,
    context: VerdictContext = NO_CONTEXT,
) -> Report:
    """run_session's report, as the tree (forensics/report/tree.py). `context`: what its verdict says around the
    replayed step (the window replay, the host snapshot, the history before the crash: replay/judge/verdict_context.py)."""
    options = options or ReplayOptions()
    started = time.monotonic() if started is None else started
    runner = runner_for(session)
    runner.block_major = runner.block_major and options.block_major
    try:
        if session.stream is not None:
            passes = expected_passes(
                session,
                bisect=options.bisect,
                rng_check=options.rng_check,
                fp32_check=options.fp32_check,
                remedies=options.remedies,
            )
            for line in session.stream.describe(passes, len(session.micro_batches), together=runner.block_major):
                stage(progress, line)
        streamed = runner if isinstance(runner, StreamedStepRunner) else None  # the session has a stream plan
        metered = streamed.metered(progress) if streamed is not None else progress
        report = _stages(session, runner, options, metered, dump_info, history, started, earlier, context)
        if streamed is not None:
            stage(metered, streamed.traffic_summary())
            report.stream = streamed.stream_report()
        return report
    finally:
        runner.close()


def _stages(
    session: ReplaySession,
    runner: StepRunner,
    options: ReplayOptions,
    progress: Progress | None,
    dump_info: dict | None,
    history: dict | None,
    started: float,
    earlier: Callable[[], EarlierState] | None = None,
    context: VerdictContext = NO_CONTEXT,
) -> Report:
    """run_session's stages, in order, on one runner."""
    findings = reproduce_step(runner, options, progress)
    raised = findings.kind is TriggerKind.EXCEPTION  # the step stops where it raises: no numbers to measure
    localise(findings, runner, options, progress)
    if not raised:
        stage(progress, "per-layer gradient norms and output abs-max (read from the reproduce pass)")
        per_layer = findings.reproduction.per_layer
        findings.per_layer = per_layer if per_layer is not None else per_layer_stats(runner)
    result = findings.reproduction.result
    if findings.reproduced and result.norm_overflow and findings.kind is TriggerKind.NONFINITE_GRAD:
        stage(progress, "every gradient is finite but their norm overflows: measuring the largest")
        findings.norm_overflow = largest_gradient(runner)
    find_culprits(findings, runner, options, progress)
    weigh_precision(findings, runner, options, progress)
    _locate_weights(findings, runner, progress)
    # the samples the verdict blames so far (replay/judge/verdict.blamed_samples): a sample found on a state at the
    # edge of fp16 gets no row of its own beyond the table's cap, and no remedy drops it
    if not raised:
        stage(progress, "per-sample loss and gradient norm")
        findings.per_sample = per_sample_rows(
            runner, session.sample_refs, blamed_samples(findings), options.max_per_sample
        )
    elif findings.culprits and findings.exception is not None:
        stage(progress, "naming the values that make the culprit samples raise")
        findings.exception = localize_exception(runner, findings.culprits) or findings.exception
    if session.grad_norms_scaled:  # the job's grad norms were of scaled gradients: read them unscaled
        history = unscaled_history(history)
    findings.history = history_finding(history, uniform_loss(runner.model), (dump_info or {}).get("step"))
    if findings.reproduced and not raised and options.remedies:
        stage(progress, "trying remedies on the step")
        findings.remedies = try_remedies(
            runner,
            blamed_samples(findings),
            findings.history.reading.healthy_grad_norm,
            findings.forward.module if findings.forward is not None else None,
        )
        if findings.remedies and session.followup is not None:
            stage(progress, "carrying the fixes over the recorded steps after this one")
            follow_remedies(findings.remedies, runner, session.followup)
    if _diverged_elsewhere(findings) and earlier is not None and session.stream is None:
        state = earlier()
        onset = findings.history.reading.onset  # a state from after the loss left its start is no counterfactual
        if state.step is None or onset is None or state.step < onset:
            stage(progress, f"feeding the step's samples to {state.source} (a broken state or bad records?)")
            refs = [SampleRef(r["micro_batch"], r["index"], r["sample_id"]) for r in findings.per_sample]
            findings.earlier_rows = rows_on_earlier_state(runner, state, refs, (dump_info or {}).get("step"))
    # with the history known, a spike in a run that diverged long before blames no sample: no evidence is weighed
    if (blamed := blamed_samples(findings)) and not raised:
        findings.evidence = weigh_evidence(findings, blamed, session, runner)
        if earlier is not None and session.stream is None:
            state = earlier()
            stage(progress, f"feeding the culprit micro-batch's samples to {state.source} (trigger or cause?)")
            feed_earlier_state(runner, state, blamed, findings.kind, findings.evidence, (dump_info or {}).get("step"))
    return assemble_report(findings, runner, dump_info, started, context)


def _diverged_elsewhere(findings: Findings) -> bool:
    """A non-finite gradient norm replayed finite but far out of the run's range, with every sample's row run
    (verdict_facts.diverged_here decides on the rows): the samples are fed to an earlier state to tell state from
    data."""
    norm = findings.reproduction.result.grad_norm
    healthy = findings.history.reading.healthy_grad_norm
    return (
        not findings.reproduced
        and findings.kind is TriggerKind.NONFINITE_GRAD
        and bool(findings.per_sample)
        and norm is not None
        and healthy is not None
        and math.isfinite(norm)
        and norm >= DIVERGED_TIMES_HEALTHY * healthy
    )


def _locate_weights(findings: Findings, runner: StepRunner, progress: Progress | None) -> None:
    """Weights non-finite before the step: their bad slices and the samples that touch them (not streamed)."""
    session = runner.session
    if findings.weights_nonfinite and session.stream is not None:
        session.warnings.append(
            "streamed replay: the non-finite pre-step weights are named, but their bad slices and "
            "the samples that touch them are not located (that stage reads whole weights)"
        )
    elif findings.weights_nonfinite:
        stage(progress, "locating the non-finite weights and the samples that touch them")
        findings.corrupted = corrupted_weights(runner)
        findings.touching = samples_touching_embeddings(runner, findings.corrupted)


__all__ = ["run_session", "session_report"]
