"""Orchestrate a replay: load -> reproduce -> localise -> bisect -> precision -> per-sample -> history -> verdict.

The stages are the sub-packages load/, run/, localize/, culprits/ and judge/ (docs/ARCHITECTURE.md); each returns
a typed finding (replay/judge/findings.py), and replay/judge/assemble.py builds the report from them. This module
opens and verifies the dump and picks the report's path (between steps, precursor, window, the step itself);
replay/options.py holds ReplayOptions, replay/pipeline.py runs the stages on a loaded session, replay/culprit_stage.py
is the culprit stage, replay/window_report.py a window replay.
`run_replay(dump_or_path, options)` returns the report dict of schema "forensics-report/<major>", the major of its
verdict kind (forensics.core.kinds.VerdictKind.schema_major; docs/REPORT_FORMAT.md); writing it to disk is
forensics.report's job. `run_session(session, options)` does the same for a ReplaySession built in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable

import torch

from forensics.core.errors import DumpError, ReplayError
from forensics.core.kinds import TriggerKind
from forensics.format import open_dump, open_step, spec
from forensics.format.verify import finish_verifying, set_aside_damaged, verify_the_rest
from forensics.format.location import as_location
from forensics.report.tree import Report
from forensics.replay.culprits.earlier_state import EarlierState
from forensics.replay.judge.between_steps import between_steps_report, raised_between_steps
from forensics.replay.judge.precursor import crash_history_block, precursor_report
from forensics.replay.judge.silent import silent_report
from forensics.replay.judge.verdict_context import VerdictContext
from forensics.replay.load.environment import deterministic_mode
from forensics.replay.load.session import step_micro_batches
from forensics.replay.load.user_code import as_user_error, recipe_is_built_in
from forensics.replay.options import ReplayOptions, load
from forensics.replay.pipeline import run_session, session_report
from forensics.replay.run.window import dump_snapshot, load_checkpoint
from forensics.replay.stages import CONFIRM_ROUNDS, Progress, history_finding, stage
from forensics.replay.window_report import window_report

logger = logging.getLogger(__name__)


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
        try:
            return _report_of(dump, dump_or_path, path, options, progress, started)
        except BaseException:  # its fetch stops with the replay (object storage: no GET after the error)
            dump.close()
            raise
    return _report_of(dump, dump_or_path, path, options, progress, started)


def _report_of(
    dump: Any, dump_or_path: Any, path: str, options: ReplayOptions, progress: Progress | None, started: float
) -> Report:
    dump.prefetch()  # object storage: every file on its way while the model is built (forensics.format.prefetch)
    stage(progress, "verifying every file the dump lists")
    damaged = set_aside_damaged(dump)  # a damaged essential file ends the replay here (DumpCorruptError)
    missing = list(dump.manifest.get("missing_ranks") or [])
    if not hasattr(dump_or_path, "manifest") and as_location(path).is_dir():
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
    if dump.trigger.kind is TriggerKind.SILENT_CORRUPTION:  # digests of the step against the job's two runs
        with deterministic_mode(dump.manifest.get("determinism")):
            report = silent_report(dump, options, dump_info, history_finding(dump.history()), started, progress)
        return _checked(dump, report)
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
            session = load(dump, options, weights=not (dump.state_missing and checkpoint is not None))
            if session.stream is not None and checkpoint is not None:
                raise ReplayError(
                    "a window replay (--from, or the Guard's host snapshot in the dump) is not streamed: "
                    "pass --no-window to analyse the dumped step streamed, or replay on a device the "
                    "state fits"
                )
            verify_the_rest(dump)
            if checkpoint is not None:
                return _checked(dump, window_report(dump, session, checkpoint, options, progress, dump_info, started))
            before = crash_history_block(dump)  # the statistics before the crash, the run's earlier dumps
            report = session_report(
                session,
                options,
                progress,
                dump_info=dump_info,
                history=dump.history(),
                started=started,
                earlier=_snapshot_state(dump),
                context=VerdictContext(snapshot_unused=unused, crash_history=before),
            )
            report.precursor_history = before
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


def _checked(dump: Any, report: Report) -> Report:
    """`report`, once every file of the dump has matched its digests: the state's large files were verified
    in the background while they streamed (forensics.format.verify.set_aside_damaged); the parts replay never read
    are waited for here. A damage found now raises DumpCorruptError: the findings would rest on it."""
    finish_verifying(dump)
    return report


def _off_the_gpu_after_a_cuda_error(dump: Any, options: ReplayOptions, progress: Progress | None) -> ReplayOptions:
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


__all__ = ["ReplayOptions", "replay_report", "run_replay", "run_session", "CONFIRM_ROUNDS"]
