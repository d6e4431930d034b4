"""The replay's stages, each a function of the step runner and what the earlier stages found (replay/engine.py runs
them in order): reproduce the step, localise the first non-finite value, bisect the samples, the per-sample rows,
the loss history, and the evidence about the culprits' records."""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, cast

import torch

from forensics.core.kinds import HistoryPattern, Phase, TriggerKind
from forensics.replay.culprits.bisect import bisect_budget, ddmin
from forensics.replay.culprits.evidence import RecordEvidence, weigh
from forensics.replay.culprits.margin import FAR_FROM_LIMIT, others_share
from forensics.replay.culprits.per_sample import SampleRow, per_sample_stats
from forensics.replay.judge.findings import Bisection, Findings, HistoryFinding
from forensics.replay.judge.history_pattern import classify_history, diverged_long_ago, history_signals, read_history
from forensics.replay.load.samples import select_samples
from forensics.replay.load.session import ReplaySession
from forensics.replay.localize.exception import localize_exception
from forensics.replay.localize.forward_backward import INPUT_MODULE, localize_backward, localize_forward
from forensics.replay.localize.update import LayerWatch, localize_optimizer
from forensics.replay.run.execute import SampleRef, StepResult, StepRunner, reproduce
from forensics.replay.run.rng_dependence import check_rng_dependence
from forensics.replay.run.streamed_runner import STREAMED_PER_SAMPLE, StreamedStepRunner

logger = logging.getLogger(__name__)

CONFIRM_ROUNDS = 3  # independent culprits looked for before concluding "no sample is to blame"
MAX_CULPRIT_SHARE = 0.5
"""A group of samples that fail only together (or whose removal ends a spike) and is more than this share of the
step's samples is no culprit: it is the step itself, not a few records, so no sample is named or blocklisted."""
Progress = Callable[[str], None]


def stage(progress: Progress | None, message: str) -> None:
    logger.info("replay: %s", message)
    if progress is not None:
        try:
            progress(message)
        except Exception:  # a broken progress callback must not stop the replay
            logger.debug("progress callback failed", exc_info=True)


def weigh_evidence(
    findings: Findings, blamed: list[SampleRef], session: ReplaySession, runner: StepRunner
) -> RecordEvidence:
    """Stage 8: is there evidence that the `blamed` culprits' records are bad data, or are they triggers?"""
    precision = cast("dict[str, Any]", findings.precision or {})
    low_job = (
        session.autocast_dtype is not None
        or session.param_dtype in (torch.float16, torch.bfloat16)
        or bool(precision.get("code_dtypes"))
    )
    full_precision = precision.get("fp32_reproduces") is True or (not low_job and not session.scaler_enabled)
    evidence = weigh(
        blamed,
        cast("list[dict]", findings.per_sample),
        findings.sample_facts,
        nonfinite_trigger=not findings.kind.spike,
        full_precision=full_precision,
        isolated=(findings.bisection.block or {}).get("test") == "isolation",
        others_far=lambda: (others_share(runner, blamed) or 1.0) < FAR_FROM_LIMIT,
        healthy_ceiling=findings.history.reading.healthy_loss_ceiling,
    )
    if not evidence.bad_data:
        logger.info("no evidence that the culprits' records are bad: they are triggers (%s)", evidence.ordinary)
    return evidence


def largest_gradient(runner: StepRunner) -> float | None:
    """The largest |gradient| of the step (a norm that overflows while every value is finite)."""
    try:
        with runner.keeping_gradients():
            runner.run(keep_grads=True)
            values = [
                float(p.grad.detach().abs().max())
                for _, p in runner.gradients()
                if p.grad is not None and p.grad.numel()
            ]
        return max(values) if values else None
    except Exception:  # a measurement: the verdict goes on without the number
        logger.warning("the largest gradient could not be measured", exc_info=True)
        return None
    finally:
        runner.reset()


def reproduce_step(runner: StepRunner, options: Any, progress: Progress | None) -> Findings:
    """Stage 1: re-run the whole step until the trigger reproduces; for an update that broke the weights,
    step a fresh copy of the optimizer; then, optionally, re-run from other seeds (is the RNG needed?)."""
    session = runner.session
    trigger = session.trigger
    kind = trigger.kind
    stage(progress, f"reproducing the step ({len(session.micro_batches)} micro-batch(es), trigger {kind})")
    # the per-layer table is read from the reproduce pass itself (a step that raised has none): no pass of its own
    watch = LayerWatch(runner) if kind is not TriggerKind.EXCEPTION else None
    reproduction = reproduce(runner, options.max_attempts, watch=watch)
    trigger = session.trigger  # in the replay's units (a grad norm recorded on scaled gradients: unscaled)
    findings = Findings(
        kind=kind,
        trigger=trigger,
        threshold=trigger.threshold,
        reproduction=reproduction,
        reproduced=reproduction.reproduced,
        weights_nonfinite=list(runner.nonfinite_params),
    )
    if kind is TriggerKind.NONFINITE_PARAM and not findings.weights_nonfinite:
        stage(progress, "stepping a fresh copy of the optimizer on the replayed gradients")
        findings.optimizer = localize_optimizer(runner)
        findings.reproduced = findings.optimizer is not None
    if (
        findings.reproduced
        and options.rng_check
        and kind is not TriggerKind.NONFINITE_PARAM
        and not findings.weights_nonfinite
        and findings.optimizer is None
    ):
        if any(state is not None for state in session.rng_states):
            stage(progress, "re-running the step from other seeds (is the recorded RNG needed?)")
            findings.rng = check_rng_dependence(runner, kind, findings.threshold)
        else:
            findings.rng = {"checked": False, "seeds": [], "failed": [], "rng_dependent": None}
    return findings


def localise(findings: Findings, runner: StepRunner, options: Any, progress: Progress | None) -> None:
    """Stage 2: where the first non-finite value appeared: forward (op by op), backward (anomaly mode) or
    the optimizer update."""
    if not findings.reproduced:
        return
    if findings.kind is TriggerKind.EXCEPTION:
        stage(progress, "localising where the step raises")
        findings.exception = localize_exception(runner)
        findings.phase = findings.exception.phase if findings.exception is not None else None
        return
    result = findings.reproduction.result
    if findings.weights_nonfinite:
        stage(progress, f"the pre-step weights are already non-finite ({findings.weights_nonfinite[0]} ...)")
    if not result.loss_finite:
        stage(progress, "localising the first non-finite value in the forward pass")
        findings.forward = localize_forward(runner, allow_neg_inf_masks=options.allow_neg_inf_masks)
        findings.phase = Phase.FORWARD if findings.forward is not None else None
    elif not result.grads_finite:
        stage(progress, "localising the first non-finite gradient (anomaly mode)")
        findings.backward = localize_backward(runner)
        findings.phase = Phase.BACKWARD if findings.backward is not None else None
    if (
        findings.optimizer is None
        and result.loss_finite
        and result.grads_finite
        and runner.session.optimizer
        and not findings.weights_nonfinite
        and not findings.kind.spike
    ):
        findings.optimizer = localize_optimizer(runner)
    if findings.optimizer is not None and findings.phase is None:
        findings.phase = Phase.OPTIMIZER


def bisect_samples(
    runner: StepRunner, refs: list[SampleRef], kind: TriggerKind, threshold: float | None, options: Any
) -> Bisection:
    """Stage 3: the smallest set of samples that makes the step fail (ddmin), confirmed by removal."""
    # A NaN/Inf is isolated: the culprit fails on its own. A spike is judged against a threshold set by
    # the whole batch, and a few samples alone are noisier than the batch (the norm of a mean of fewer
    # gradients is larger), so a spike culprit is the smallest set whose REMOVAL ends the spike.
    needs_backward, by_removal = kind.needs_backward, kind.spike

    answered: dict[tuple[SampleRef, ...], StepResult] = {}

    def run_fails(subset: list[SampleRef]) -> bool:
        result = answered.pop(tuple(subset), None)
        if result is None:
            result = runner.run(subset, backward=needs_backward)
        elif result.unrunnable and result.raised is not None:
            runner.note_unrunnable(result.raised)  # told now, as the run would have told it
        return result.trigger_reproduced(kind, threshold)

    def fed(subset: list[SampleRef]) -> list[SampleRef]:
        """The samples a test of `subset` runs: the subset, or for a removal test the others."""
        chosen = set(subset)
        return [r for r in refs if r not in chosen] if by_removal else list(subset)

    def fails(subset: list[SampleRef]) -> bool:
        if by_removal:
            rest = fed(subset)
            return not rest or not run_fails(rest)
        return run_fails(subset)

    def prefetch(subsets: list[list[SampleRef]]) -> None:
        """The forward passes ddmin may ask for next, run together (a streamed runner: block by block, each block
        brought to the device once); what they would tell the report is told when ddmin asks (run_fails)."""
        runs = [fed(s) for s in subsets]
        runs = [r for r in runs if r and tuple(r) not in answered]
        with runner.speculating():
            results = runner.run_forwards([functools.partial(runner.run, r, backward=False) for r in runs])
        answered.update({tuple(r): result for r, result in zip(runs, results)})

    if len(refs) == 1:
        return Bisection(
            list(refs),
            {
                "runs": 0,
                "candidates": 1,
                "culprit_size": 1,
                "budget": bisect_budget(1),
                "confirmed": None,
                "test": "isolation",
            },
        )
    ahead = prefetch if runner.block_major and not needs_backward else None
    outcome = ddmin(refs, fails, max_runs=options.max_bisect_runs, prefetch=ahead)
    runs, culprits, confirmed = outcome.runs, [] if outcome.all_failed else list(outcome.culprits), None
    groups = 1
    if culprits and not by_removal:
        # Confirm: without the culprits the step must pass. Several samples may each fail alone; look
        # for up to CONFIRM_ROUNDS of them. More than that, or a micro-batch where any sample fails
        # (a dropout mask, a broken buffer), is no sample's fault.
        for _ in range(CONFIRM_ROUNDS):
            rest = [r for r in refs if r not in set(culprits)]
            runs += 1
            if not rest or not run_fails(rest):
                confirmed = True
                break
            more = ddmin(rest, fails, max_runs=options.max_bisect_runs, prefetch=ahead)
            runs += more.runs
            if more.all_failed:
                break
            culprits += [r for r in more.culprits if r not in set(culprits)]
            groups += 1
        if not confirmed:
            logger.info(
                "the step still fails without samples %s: no sample is to blame", [r.sample_id for r in culprits]
            )
            confirmed, culprits = False, []
    too_large = len(culprits) > 1 and groups == 1 and len(culprits) > MAX_CULPRIT_SHARE * len(refs)
    if too_large:
        logger.info(
            "the smallest failing set is %d of %d samples: too large a share of the step to blame",
            len(culprits),
            len(refs),
        )
    block = {
        "runs": runs,
        "candidates": len(refs),
        "culprit_size": 0 if too_large else len(culprits),
        "unblamed_group": len(culprits) if too_large else 0,
        "budget": outcome.budget,
        "all_subsets_fail": outcome.all_failed,
        "minimal": outcome.minimal,
        "test": "removal" if by_removal else "isolation",
        "confirmed": confirmed,
        "independent_groups": groups if culprits and not too_large else 0,
    }
    return Bisection([] if too_large else culprits, block, outcome.all_failed)


def input_field(forward: Any) -> tuple[int, str] | None:
    """(micro-batch, field) when the forward finding names a batch field (`<input>.FIELD`) in a known micro-batch."""
    if (
        forward is not None
        and forward.micro_batch is not None
        and bool(forward.nonfinite_inputs)
        and (forward.module or "").startswith(INPUT_MODULE + ".")
    ):
        return forward.micro_batch, forward.nonfinite_inputs[0]
    return None


def per_sample_rows(
    runner: StepRunner, refs: list[SampleRef], culprits: list[SampleRef], limit: int
) -> list[SampleRow]:
    """Stage 5: loss and gradient norm of each sample alone (culprits first, then up to `limit`)."""
    if not refs or limit <= 0:
        return []
    chosen = list(culprits[:limit])
    chosen += [r for r in refs if r not in chosen][: max(0, limit - len(chosen))]
    chosen.sort(key=lambda r: (r.micro_batch, r.index))
    session, model = runner.session, runner.model
    if isinstance(runner, StreamedStepRunner):  # one streamed pass per row: the culprits and a few others
        few = [r for r in chosen if r in set(culprits)] or []
        few += [r for r in chosen if r not in set(few)][: max(0, STREAMED_PER_SAMPLE - len(few))]
        if len(few) < len(chosen):
            session.warnings.append(
                f"streamed replay: per-sample rows for {len(few)} of {len(chosen)} samples (the "
                "culprits first), each being a pass over the whole model"
            )
        few.sort(key=lambda r: (r.micro_batch, r.index))
        return cast("list[SampleRow]", runner.per_sample_rows(few))  # the same rows, built by the streamed runner

    def run_one(ref: SampleRef) -> torch.Tensor:
        batch = select_samples(session.micro_batches[ref.micro_batch], [ref.index])
        with runner.autocast_context():
            return session.loss_fn(model, batch)

    def before_each(ref: SampleRef) -> None:
        runner.restore_rng(ref.micro_batch)

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        with runner.autocast_context():
            return session.loss_fn(m, batch)

    runner.reset()
    model.train()
    try:
        with runner.job_precision():  # an FSDP2 bf16 job's samples in bf16, as the step ran them
            return per_sample_stats(
                model, chosen, run_one, before_each=before_each, batches=session.micro_batches, loss_fn=loss_fn
            )
    finally:
        runner.reset()


def uniform_loss(model: torch.nn.Module) -> float | None:
    """ln(vocabulary size): the loss of a uniform guess, for a language model that says its vocabulary."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return math.log(vocab) if isinstance(vocab, int) and vocab > 1 else None


def history_finding(history: dict | None, uniform_loss: float | None = None, step: int | None = None) -> HistoryFinding:
    """Stage 6: the recorded history's curve shape and warning signals, whether the run diverged long ago, and
    what it shows before `step` (the analysed one) with numbers from before the divergence."""
    if not history:
        return HistoryFinding(None, HistoryPattern.INSUFFICIENT_HISTORY, reading=read_history(None, step))
    block = {
        "step": list(history.get("step") or []),
        "loss": list(history.get("loss") or []),
        "grad_norm": list(history.get("grad_norm") or []),
    }
    try:
        signals = history_signals(history)
    except Exception:  # signals are an extra; never fail the replay on them
        logger.warning("history signals failed", exc_info=True)
        signals = []
    summary = history.get("summary")
    if not isinstance(summary, dict):
        summary = {}
    pattern = classify_history(block["loss"], summary.get("first_losses") or block["loss"][:3], uniform_loss)
    return HistoryFinding(
        block,
        HistoryPattern(pattern),
        signals,
        diverged_long_ago(history, uniform_loss),
        read_history(history, step, uniform_loss),
    )
