"""The verdict's words of a window replay (replay/run/window.py): the step that broke the run before the crash, a
break at the window's first step, which the replay could not look behind, and a host snapshot it could not use."""

from __future__ import annotations

from forensics.report.tree import Verdict
from forensics.replay.run.window import SnapshotUnused


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


def say_broke_before(verdict: Verdict, step: int, dumped_step: int, why: str | None) -> None:
    """The headline of an analysed step that broke the run before the dumped one: 'The weights broke at step K (N
    steps before the crash at step D): why. ' before the step's own headline. `why`: None when the verdict itself
    says why (an update that wrecked the weights)."""
    verdict.headline = (
        f"The weights broke at step {step} ({dumped_step - step} steps before the crash at step "
        f"{dumped_step})" + (f": {why}" if why is not None else "") + ". " + (verdict.headline or "")
    )


def say_window_start(verdict: Verdict, step: int, source: str, first_step: int | None) -> None:
    """The step that broke the run is the window's first (`source`: where the window started): the replay could
    not look at the steps before it, unless it is the run's first recorded step (`first_step`)."""
    if first_step is not None and step <= first_step:
        verdict.explanation = (verdict.explanation or "") + (
            f" Step {step} is the run's first recorded step: its very first update already breaks the weights, so "
            "nothing earlier is to blame."
        )
        return
    verdict.explanation = (verdict.explanation or "") + (
        f" Step {step} is the first step the window replay re-executed (it starts at {source}), so the weights may "
        "have been breaking before it: the steps before were not checked."
    )
    verdict.suggestions = [
        *(verdict.suggestions or []),
        (
            f"To look before step {step}: replay with --from an earlier checkpoint (--from-step N), or run the job with "
            "a smaller GuardConfig(recording=RecordConfig(snapshot_every=K, window_steps=2 * K)), so the Guard's "
            "snapshot is older."
        ),
    ]
