"""A window replay's report (--from CHECKPOINT, or the Guard's host snapshot in the dump): the recorded steps
re-executed from the checkpoint (replay/run/window.py), then the step that broke the run analysed as any step
(replay/pipeline.py), its verdict told where the window started and which step broke (replay/judge/verdict_context.py);
the report gets a `window` block."""

from __future__ import annotations

from typing import Any

from forensics.core.errors import DumpError
from forensics.report.model import to_json_safe
from forensics.report.tree import Report, Window
from forensics.replay.culprits.earlier_state import EarlierState
from forensics.replay.judge.verdict_context import VerdictContext, WindowFacts
from forensics.replay.load.recipe import job_paths
from forensics.replay.load.session import ReplaySession
from forensics.replay.options import ReplayOptions, load
from forensics.replay.pipeline import session_report
from forensics.replay.run.window import Checkpoint, data_recipe, replay_window, window_block
from forensics.replay.stages import Progress, stage


def window_report(
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
        fresh = load(dump, options)
        report = session_report(
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
        window = WindowFacts(
            step=step,
            dumped_step=dump.step,
            broke=None if broken.trigger.update_change is not None else outcomes[-1].broke,  # the verdict says it
            at_window_start=step == start and bool(outcomes[-1].broke),
            source=checkpoint.source,
            first_step=(dump.history().get("summary") or {}).get("first_step"),
        )
        report = session_report(
            broken,
            options,
            progress,
            dump_info={**dump_info, "step": step},
            history=dump.history(),
            started=started,
            context=VerdictContext(window=window),
        )
    report.window = Window.parse(block)
    return report


__all__ = ["window_report"]
