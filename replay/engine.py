"""Orchestrate a replay: load -> reproduce -> localise -> bisect -> precision -> per-sample -> history -> verdict.

The stages are the sub-packages load/, run/, localize/, culprits/ and judge/ (docs/ARCHITECTURE.md); each returns
a typed finding (replay/judge/findings.py), and replay/judge/assemble.py builds the report from them.
`run_replay(dump_or_path, options)` returns the report dict of schema "forensics-report/1"
(docs/REPORT_FORMAT.md); writing it to disk is forensics.report's job. `run_session(session, options)`
does the same for a ReplaySession built in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from forensics.core.errors import DumpError, ReplayError, is_out_of_memory
from forensics.format import open_dump, open_step, spec
from forensics.format.verify import finish_verifying, set_aside_damaged, verify_the_rest
from forensics.format.limits import ArchiveLimits
from forensics.core.kinds import Phase, TriggerKind
from forensics.report.model import to_json_safe
from forensics.report.tree import Report, Window
from forensics.replay.culprits.earlier_state import EarlierState, feed_earlier_state
from forensics.replay.culprits.margin import others_margin
from forensics.replay.culprits.sample_facts import describe_samples, nonfinite_in_field, too_long
from forensics.replay.culprits.sizes import longer_than, outlier_refs, size_summary
from forensics.replay.judge.assemble import assemble_report
from forensics.replay.judge.verdict import blamed_samples
from forensics.replay.judge.between_steps import between_steps_report, raised_between_steps
from forensics.replay.run.units import unscaled_history
from forensics.replay.judge.precision import fp32_check, uses_low_precision
from forensics.replay.judge.precursor import add_crash_history, precursor_report
from forensics.replay.judge.remedies import try_remedies
from forensics.replay.judge.remedy_followup import follow_remedies
from forensics.replay.judge.window_words import say_broke_before, say_window_start, snapshot_suggestion
from forensics.replay.load.environment import deterministic_mode
from forensics.replay.load.recipe import job_paths
from forensics.replay.load.session import ReplaySession, load_session, step_micro_batches
from forensics.replay.load.user_code import as_user_error, recipe_is_built_in
from forensics.replay.localize.exception import localize_exception
from forensics.replay.localize.update import per_layer_stats
from forensics.replay.localize.weights import corrupted_weights, samples_touching_embeddings
from forensics.replay.run.execute import StepRunner
from forensics.replay.run.streamed_runner import StreamedStepRunner, expected_passes, runner_for
from forensics.replay.stages import (
    CONFIRM_ROUNDS,
    Progress,
    stage,
    weigh_evidence,
    largest_gradient,
    reproduce_step,
    localise,
    bisect_samples,
    input_field,
    per_sample_rows,
    uniform_loss,
    history_finding,
)
from forensics.replay.run.window import (
    Checkpoint,
    data_recipe,
    dump_snapshot,
    load_checkpoint,
    replay_window,
    window_block,
)

logger = logging.getLogger(__name__)


@dataclass
class ReplayOptions:
    """What `run_replay` does and what it may import."""

    device: str | None = None
    """"cuda:0", "cpu"; None: CUDA when present, else CPU."""
    trust: bool = False
    """Import the model factory / loss / optimizer class the dump names (CLI --trust)."""
    factory: str | None = None
    """"module:fn" returning the model, instead of the dump's recipe (CLI --factory)."""
    loss: str | None = None
    """"module:fn" with (model, batch) -> loss, instead of the dump's (CLI --loss)."""
    sys_path: list[str] = field(default_factory=list)
    """Directories put in front of sys.path for the imports above (CLI --path); with `trust`, the job's script and
    working directories recorded in the dump go at the end of sys.path (forensics.replay.load.recipe.job_paths)."""
    factory_kwargs: dict | None = None
    """Keyword arguments for the factory instead of the recorded ones (CLI --factory-kwargs); None: recorded."""
    loss_kwargs: dict | None = None
    """Keyword arguments for the loss instead of the recorded ones (CLI --loss-kwargs); None: recorded."""
    rank: int | None = None
    """Rank of a multi-rank step dump; None: the rank whose trigger fired, else the lowest."""
    max_attempts: int = 3
    """Full-step replays before giving up on reproducing (GPU kernels may be non-deterministic)."""
    fp32_check: bool = True
    """Re-run the culprit samples in fp32 to tell precision problems from data / model problems."""
    bisect: bool = True
    """Search for the smallest set of samples that still fails (ddmin)."""
    allow_neg_inf_masks: bool = True
    """-inf made by mask ops (masked_fill / where / full) is not reported as the first bad value."""
    max_per_sample: int = 64
    """At most this many samples get their own loss / grad-norm row (culprits always do)."""
    max_bisect_runs: int | None = 200
    """Hard cap on bisection replays (ddmin is quadratic when samples only fail together)."""
    shard_dirs: list[str] = field(default_factory=list)
    """Sharded dump written on several nodes: other nodes' directories with this step's rank dumps (--shards)."""
    archive_limits: ArchiveLimits | None = None
    """What unpacking a .tar.zst dump may produce (default forensics.format.limits.ArchiveLimits())."""
    from_checkpoint: str | None = None
    """Window replay (CLI --from): an earlier checkpoint to re-execute the recorded steps from
    (replay/run/window.py)."""
    from_step: int | None = None
    """The step the checkpoint was taken before (CLI --from-step; default: what the checkpoint says)."""
    window: bool = True
    """A dump holding the Guard's host snapshot (GuardConfig.recording.snapshot_every) and a data recipe: re-execute the
    recorded steps from the snapshot, as --from does with a checkpoint (needs trust: it imports the data
    recipe). CLI --no-window turns it off."""
    remedies: bool = True
    """Once reproduced, re-run the step under each applicable fix (drop samples, eps, fp32, loss scale, clip,
    lower LR, skip) and rank what makes it healthy; report block `remedies` (replay/judge/remedies.py)."""
    rng_check: bool = True
    """Once reproduced, re-run the step from a few other seeds (recorded RNG not restored) to tell
    whether the failure needs the dump's random state (a dropout mask); report block `rng`."""
    memory_budget: int | None = None
    """Bytes the replay may use on its device (CLI --memory-budget 16GiB; the CPU too). A state that does not fit them,
    or without a budget a GPU's free memory, is streamed block by block (replay/run/streamed_runner.py; report `stream`)."""

    def __post_init__(self):
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(
                f"ReplayOptions.memory_budget must be a positive number of bytes, got {self.memory_budget}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"ReplayOptions.max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_per_sample < 0:
            raise ValueError(f"ReplayOptions.max_per_sample must be >= 0, got {self.max_per_sample}")
        self.sys_path = [str(p) for p in self.sys_path]


def run_replay(dump_or_path: Any, options: ReplayOptions | None = None, progress: Progress | None = None) -> dict:
    """Replays a dump's failing step and returns the report dict (replay_report's tree as report.json holds it).

    Args:
        dump_or_path: a forensics.format.Dump, or a path (rank dir, step dir, .tar.zst).
        options: ReplayOptions (device, consent, rank, which analyses run).
        progress: called with a short text before each stage (the CLI prints it).
    Returns:
        The report (schema "forensics-report/1"), JSON-safe (non-finite floats as "nan"/"inf").
    Raises:
        DumpError: the dump is missing / incomplete / tampered.
        RecipeError: the model recipe needs consent (--trust / --factory) or cannot be imported.
        ReplayError: e.g. the device is not available.
    Example:
        >>> report = run_replay("crash_dumps/run/step-000000042", ReplayOptions(device="cpu"))  # doctest: +SKIP
        >>> report["verdict"]["kind"], report["culprit"]["samples"]  # doctest: +SKIP
        ('bad_sample', [{'sample_id': 'doc-17', 'micro_batch': 1, 'index': 2, 'rank': 0}])
    """
    return replay_report(dump_or_path, options, progress).as_dict()


def replay_report(dump_or_path: Any, options: ReplayOptions | None = None, progress: Progress | None = None) -> Report:
    """run_replay's report as the tree (forensics/report/tree.py) the renderers and writers read: the CLI writes it
    without turning it into a dict and parsing it back."""
    options = options or ReplayOptions()
    started = time.monotonic()
    if hasattr(dump_or_path, "manifest"):
        dump, path = dump_or_path, str(getattr(dump_or_path, "path", ""))
    else:
        path = str(dump_or_path)
        stage(progress, f"opening {path}")
        dump = open_dump(dump_or_path, rank=options.rank, limits=options.archive_limits, shard_dirs=options.shard_dirs)
    stage(progress, "verifying every file the dump lists")
    damaged = set_aside_damaged(dump)  # a damaged essential file ends the replay here (DumpCorruptError)
    missing = list(dump.manifest.get("missing_ranks") or [])
    if not hasattr(dump_or_path, "manifest") and Path(path).is_dir():
        with contextlib.suppress(Exception):  # a rank directory alone: nothing more to learn
            missing = sorted(set(missing) | set(open_step(path, options.archive_limits)[1]))
    if dump.sharded:  # the ranks beside it and in --shards directories all count
        dump.shards  # noqa: B018 - refuses an incomplete sharded dump now, naming what is missing
        missing = sorted(set(range(dump.world_size)) - {dump.rank, *(d.rank for d in dump.peers())})
    dump_info = {
        "path": path,
        "run_id": dump.manifest.get("run_id"),
        "step": dump.step,
        "rank": dump.rank,
        "world_size": dump.world_size,
        "missing_ranks": missing,
        "num_micro_batches": max(dump.num_micro_batches, step_micro_batches(dump.manifest)),
        "damaged": [d.as_dict() for d in damaged],
    }
    if raised_between_steps(dump.manifest):  # the loop's own code raised: no model step to replay
        stage(progress, "the exception was raised between steps: nothing to replay")
        return _checked(dump, between_steps_report(dump, dump_info, history_finding(dump.history()), started))
    if dump.num_micro_batches == 0:
        raise DumpError(
            f"{path or 'the dump'} records no micro-batch, so there is no step to replay; the loop "
            "called check() without record_batch() (see README: the four calls)"
        )
    if dump.trigger.kind is TriggerKind.PRECURSOR:
        stage(progress, "a precursor dump (a healthy step): ranking the statistics that grew")
        return _checked(dump, precursor_report(dump, dump_info, history_finding(dump.history()), started))
    options = _off_the_gpu_after_a_cuda_error(dump, options, progress)
    with deterministic_mode(dump.manifest.get("determinism")):
        stage(
            progress,
            f"loading model and step {dump.step} (rank {dump.rank}) on {options.device or 'the default device'}",
        )
        try:
            checkpoint, unused = (
                (load_checkpoint(options.from_checkpoint), None)
                if options.from_checkpoint
                else dump_snapshot(dump, options.window or bool(dump.state_missing), options.trust)
            )
            session = _load(dump, options, weights=not (dump.state_missing and checkpoint is not None))
            if session.stream is not None and checkpoint is not None:
                raise ReplayError(
                    "a window replay (--from, or the Guard's host snapshot in the dump) is not streamed: "
                    "pass --no-window to analyse the dumped step streamed, or replay on a device the "
                    "state fits"
                )
            verify_the_rest(dump)
            if checkpoint is not None:
                return _checked(dump, _window_replay(dump, session, checkpoint, options, progress, dump_info, started))
            report = _session_report(
                session,
                options,
                progress,
                dump_info=dump_info,
                history=dump.history(),
                started=started,
                earlier=_snapshot_state(dump),
            )
            add_crash_history(report, dump)  # the statistics before the crash, the run's earlier dumps
            if unused is not None:
                report.verdict.suggestions = [snapshot_suggestion(unused), *(report.verdict.suggestions or [])]
            return _checked(dump, report)
        except Exception as exc:  # the user's model / loss raising on the dump's data is theirs
            converted = as_user_error(
                exc, f"replaying step {dump.step}", recipe_is_built_in(dump.recipe, options.factory, options.loss)
            )
            if converted is exc:
                raise
            raise converted from exc


def _snapshot_state(dump: Any) -> Callable[[], EarlierState] | None:
    """The Guard's host snapshot in the dump as an earlier state to feed the culprits to (weights only: reading
    tensors needs no consent), read only if a stage asks for it; None for a dump without one."""
    step = dump.snapshot_step
    if step is None:
        return None
    return lambda: EarlierState(
        dump.model_state(spec.SNAPSHOT_STATE), step, f"the Guard's host snapshot of step {step} (in the dump)"
    )


def _load(dump: Any, options: ReplayOptions, weights: bool = True) -> ReplaySession:
    """The dump's step as a live session, on the options' device, with their consent and user code."""
    return load_session(
        dump,
        device=options.device,
        trust=options.trust,
        factory=options.factory,
        loss=options.loss,
        sys_path=options.sys_path,
        weights=weights,
        memory_budget=options.memory_budget,
        factory_kwargs=options.factory_kwargs,
        loss_kwargs=options.loss_kwargs,
    )


def _checked(dump: Any, report: Report) -> Report:
    """`report`, once every file of the dump has matched its digests: the state's large files were verified
    in the background while they streamed (forensics.format.verify.set_aside_damaged); the parts replay never read
    are waited for here. A damage found now raises DumpCorruptError: the findings would rest on it."""
    finish_verifying(dump)
    return report


def _off_the_gpu_after_a_cuda_error(dump: Any, options: "ReplayOptions", progress: Progress | None) -> "ReplayOptions":
    """A step that raised a CUDA error (a device-side assert) is replayed on the CPU: on a GPU the same bad index
    would poison this process's CUDA context too, while the CPU raises a readable error at the op itself."""
    exception = dump.manifest.get("exception")
    if not (isinstance(exception, dict) and exception.get("cuda_error")):
        return options
    if options.device is None and not torch.cuda.is_available() or str(options.device or "cuda").startswith("cpu"):
        return options
    stage(
        progress,
        "the step raised a CUDA error (device-side assert): replaying on the CPU, where the same op "
        "raises a readable error and nothing poisons the GPU",
    )
    return dataclasses.replace(options, device="cpu")


def _window_replay(
    dump: Any,
    session: ReplaySession,
    checkpoint: Checkpoint,
    options: ReplayOptions,
    progress: Progress | None,
    dump_info: dict,
    started: float,
) -> Report:
    """--from CHECKPOINT (or the dump's own host snapshot): re-execute the recorded steps from the checkpoint;
    analyse the step that broke the run (or, when none did, the dumped step); the report gets a `window` block."""
    start = options.from_step if options.from_step is not None else checkpoint.step
    if start is None:
        raise DumpError(
            f"say which step {checkpoint.source} was taken before: --from-step N (a forensics dump, or a "
            "directory with trainer_state.json, says it itself)"
        )
    if not 0 <= start <= dump.step:
        raise DumpError(f"--from-step {start} is not before the dumped step {dump.step}")
    job_dirs = job_paths(dump.manifest.get("environment"), dump.path) if options.trust else []
    data = data_recipe(dump.manifest.get("data_recipe"), options.trust, list(options.sys_path), job_dirs)
    outcomes, broken = replay_window(
        session, dump, checkpoint, start, data, lambda m: stage(progress, m), through_dumped=bool(dump.state_missing)
    )
    block = to_json_safe(window_block(outcomes, start, dump.step, checkpoint))
    if broken is None:
        stage(progress, f"no step from {start} to {dump.step - 1} broke the weights: analysing the dumped step")
        fresh = _load(dump, options)
        report = _session_report(
            fresh,
            options,
            progress,
            dump_info=dump_info,
            history=dump.history(),
            started=started,
            earlier=lambda: EarlierState(checkpoint.model, checkpoint.step, checkpoint.source),
        )
    else:
        step = outcomes[-1].step
        stage(
            progress,
            f"step {step} broke the run ({outcomes[-1].broke}): analysing it"
            if outcomes[-1].broke
            else f"re-executed up to the dumped step {step}: analysing it",
        )
        report = _session_report(
            broken, options, progress, dump_info={**dump_info, "step": step}, history=dump.history(), started=started
        )
        if step < dump.step:
            why = None if broken.trigger.update_change is not None else outcomes[-1].broke  # the verdict says it
            say_broke_before(report.verdict, step, dump.step, why)
        if step == start and outcomes[-1].broke:
            say_window_start(
                report.verdict, step, checkpoint.source, (dump.history().get("summary") or {}).get("first_step")
            )
    report.window = Window.parse(block)
    return report


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
        The report dict (see run_replay).
    """
    return _session_report(
        session,
        options,
        progress,
        dump_info=dump_info,
        history=history,
        started=started,
        earlier=(lambda: earlier) if earlier is not None else None,
    ).as_dict()


def _session_report(
    session: ReplaySession,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    *,
    dump_info: dict | None = None,
    history: dict | None = None,
    started: float | None = None,
    earlier: Callable[[], EarlierState] | None = None,
) -> Report:
    """run_session's report, as the tree (forensics/report/tree.py)."""
    options = options or ReplayOptions()
    started = time.monotonic() if started is None else started
    runner = runner_for(session)
    try:
        if session.stream is not None:
            passes = expected_passes(
                session,
                bisect=options.bisect,
                rng_check=options.rng_check,
                fp32_check=options.fp32_check,
                remedies=options.remedies,
            )
            for line in session.stream.describe(passes, len(session.micro_batches)):
                stage(progress, line)
        report = _stages(session, runner, options, progress, dump_info, history, started, earlier)
        if isinstance(runner, StreamedStepRunner):  # the session has a stream plan
            report.stream = runner.stream_report()
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
) -> Report:
    """run_session's stages, in order, on one runner."""
    findings = reproduce_step(runner, options, progress)
    raised = findings.kind is TriggerKind.EXCEPTION  # the step stops where it raises: no numbers to measure
    localise(findings, runner, options, progress)
    if not raised:
        stage(progress, "per-layer gradient norms and output abs-max")
        findings.per_layer = per_layer_stats(runner)
    refs = session.sample_refs
    result = findings.reproduction.result
    if findings.reproduced and result.norm_overflow and findings.kind is TriggerKind.NONFINITE_GRAD:
        stage(progress, "every gradient is finite but their norm overflows: measuring the largest")
        findings.norm_overflow = largest_gradient(runner)
    data_independent = (
        findings.kind.data_independent
        or bool(findings.weights_nonfinite)
        or findings.phase is Phase.OPTIMIZER
        or findings.norm_overflow is not None
    )
    largest = []
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
    if raised:
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
        findings.margin = others_margin(runner, findings.culprits)  # the verdict decides whether they are blamed
    if findings.weights_nonfinite and session.stream is not None:
        session.warnings.append(
            "streamed replay: the non-finite pre-step weights are named, but their bad slices and "
            "the samples that touch them are not located (that stage reads whole weights)"
        )
    elif findings.weights_nonfinite:
        stage(progress, "locating the non-finite weights and the samples that touch them")
        findings.corrupted = corrupted_weights(runner)
        findings.touching = samples_touching_embeddings(runner, findings.corrupted)
    if not raised:
        stage(progress, "per-sample loss and gradient norm")
        findings.per_sample = per_sample_rows(runner, refs, blamed_samples(findings), options.max_per_sample)
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
    if (blamed := blamed_samples(findings)) and not raised:
        findings.evidence = weigh_evidence(findings, blamed, session, runner)
        if earlier is not None and session.stream is None:
            state = earlier()
            stage(progress, f"feeding the culprit micro-batch's samples to {state.source} (trigger or cause?)")
            feed_earlier_state(runner, state, blamed, findings.kind, findings.evidence, (dump_info or {}).get("step"))
    return assemble_report(findings, runner, dump_info, started)


__all__ = ["ReplayOptions", "replay_report", "run_replay", "run_session", "CONFIRM_ROUNDS"]
