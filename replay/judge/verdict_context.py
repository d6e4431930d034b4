"""What the verdict of a replayed step says about its surroundings, handed to it as facts (`VerdictContext`): the
window replay (the step that broke the run before the crash; a break at the window's first step, which the replay
could not look behind), a host snapshot the replay could not use, and what the run's statistics and earlier dumps
showed before the crash (replay/judge/precursor.crash_history). replay/judge/verdict.decide_verdict words them into
the verdict it decides (`in_context`); nothing adds them to a verdict afterwards."""

from __future__ import annotations

from dataclasses import dataclass

from forensics.report.tree import Verdict
from forensics.replay.run.window import SnapshotUnused


@dataclass(frozen=True)
class WindowFacts:
    """A window replay's step that broke the run (replay/window_report.py)."""

    step: int
    """The analysed step: the first whose update broke the weights (or the dumped step the window re-executed)."""
    dumped_step: int
    """The step the Guard dumped: `step` is before it when the weights broke earlier."""
    broke: str | None = None
    """What broke at `step`, in words (replay/run/window.WindowStep.broke); None: the verdict itself says why (an
    update that wrecked the weights)."""
    at_window_start: bool = False
    """The break is at the window's first step: the replay could not look behind it."""
    source: str = ""
    """Where the window started (the checkpoint, or the Guard's host snapshot)."""
    first_step: int | None = None
    """The run's first recorded step (the history's summary), or None."""


@dataclass(frozen=True)
class VerdictContext:
    """The facts around the replayed step that its verdict words (the module docstring); the default: none."""

    window: WindowFacts | None = None
    snapshot_unused: SnapshotUnused | None = None
    """The dump holds the Guard's host snapshot, but the window replay could not start from it."""
    crash_history: dict | None = None
    """The report's `precursor_history` block (replay/judge/precursor.crash_history, or the run's earlier dumps)."""


NO_CONTEXT = VerdictContext()


def in_context(verdict: Verdict, context: VerdictContext) -> Verdict:
    """`verdict` (as its rule worded it) with what `context` adds: the step that broke before the crash leads the
    headline; the window's start, then the history before the crash, close the explanation; how to use the host
    snapshot leads the suggestions, how to look before the window's start closes them. `verdict` itself when the
    context adds nothing."""
    headline, explanation, suggestions = verdict.headline, verdict.explanation, verdict.suggestions
    window = context.window
    if window is not None and window.step < window.dumped_step:
        headline = broke_before(window) + (headline or "")
    if window is not None and window.at_window_start:
        sentence, look_before = window_start(window)
        explanation = (explanation or "") + sentence
        if look_before is not None:
            suggestions = [*(suggestions or []), look_before]
    if context.crash_history is not None and context.crash_history.get("sentence"):
        explanation = ((explanation or "") + crash_history_words(context.crash_history)).strip()
    if context.snapshot_unused is not None:
        suggestions = [snapshot_suggestion(context.snapshot_unused), *(suggestions or [])]
    if (headline, explanation, suggestions) == (verdict.headline, verdict.explanation, verdict.suggestions):
        return verdict
    return Verdict(kind=verdict.kind, headline=headline, explanation=explanation, suggestions=suggestions)


def snapshot_suggestion(unused: SnapshotUnused) -> str:
    """How to get the window replay from the Guard's host snapshot the dump holds (the first suggestion)."""
    if unused.no_data_recipe:
        return (
            f"The dump holds the Guard's host snapshot of step {unused.step} but no data recipe, so the steps "
            "since then cannot be re-executed: set GuardConfig(dumping=DumpConfig(data_recipe=...)) in the job."
        )
    return (
        f"Re-run with --trust: the dump holds the Guard's host snapshot of step {unused.step}, and the window "
        "replay re-executes the steps since then (importing the job's data recipe) to find the step "
        "whose update broke the weights."
    )


def broke_before(window: WindowFacts) -> str:
    """What leads the headline of an analysed step that broke the run before the dumped one: 'The weights broke at
    step K (N steps before the crash at step D): why. ' (no why when the verdict itself says it)."""
    step, dumped = window.step, window.dumped_step
    return (
        f"The weights broke at step {step} ({dumped - step} steps before the crash at step "
        f"{dumped})" + (f": {window.broke}" if window.broke is not None else "") + ". "
    )


def window_start(window: WindowFacts) -> tuple[str, str | None]:
    """The step that broke the run is the window's first: the sentence closing the explanation (the replay could
    not look at the steps before it, unless it is the run's first recorded step), and how to look before it."""
    step = window.step
    if window.first_step is not None and step <= window.first_step:
        return (
            f" Step {step} is the run's first recorded step: its very first update already breaks the weights, so "
            "nothing earlier is to blame."
        ), None
    return (
        f" Step {step} is the first step the window replay re-executed (it starts at {window.source}), so the weights "
        "may have been breaking before it: the steps before were not checked."
    ), (
        f"To look before step {step}: replay with --from an earlier checkpoint (--from-step N), or run the job with "
        "a smaller GuardConfig(recording=RecordConfig(snapshot_every=K, window_steps=2 * K)), so the Guard's "
        "snapshot is older."
    )


def crash_history_words(block: dict) -> str:
    """The sentence closing a crash verdict's explanation: the growth before the crash, the earlier dumps to compare
    with (the report's `precursor_history` block, whose `sentence` is set)."""
    before = f"Before it, {block['sentence']}" if block.get("lead") else block["sentence"]
    words = " " + before + "."
    if block["earlier_dumps"]:
        words += " Replay them (`forensics replay STEP_DIR`) to see how it built up."
    return words


__all__ = [
    "NO_CONTEXT",
    "VerdictContext",
    "WindowFacts",
    "broke_before",
    "crash_history_words",
    "in_context",
    "snapshot_suggestion",
    "window_start",
]
