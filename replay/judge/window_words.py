"""The verdict's words of a window replay (replay/run/window.py): the step that broke the run before the crash, and
a break at the window's first step, which the replay could not look behind."""

from __future__ import annotations


def say_broke_before(verdict: dict, step: int, dumped_step: int, why: str | None) -> None:
    """The headline of an analysed step that broke the run before the dumped one: 'The weights broke at step K (N
    steps before the crash at step D): why. ' before the step's own headline. `why`: None when the verdict itself
    says why (an update that wrecked the weights)."""
    verdict["headline"] = (f"The weights broke at step {step} ({dumped_step - step} steps before the crash at step "
                           f"{dumped_step})" + (f": {why}" if why is not None else "") + ". " + verdict["headline"])


def say_window_start(verdict: dict, step: int, source: str, first_step: int | None) -> None:
    """The step that broke the run is the window's first (`source`: where the window started): the replay could
    not look at the steps before it, unless it is the run's first recorded step (`first_step`)."""
    if first_step is not None and step <= first_step:
        verdict["explanation"] += (f" Step {step} is the run's first recorded step: its very first update already "
                                   "breaks the weights, so nothing earlier is to blame.")
        return
    verdict["explanation"] += (f" Step {step} is the first step the window replay re-executed (it starts at "
                               f"{source}), so the weights may have been breaking before it: the steps "
                               "before were not checked.")
    verdict["suggestions"].append(
        f"To look before step {step}: replay with --from an earlier checkpoint (--from-step N), or run the job with "
        "a smaller GuardConfig(snapshot_every=K) and window_steps >= 2 x K, so the Guard's snapshot is older.")
