"""The verdicts of dumps with no step to replay, each the one kind its dump fixes: a precursor dump's
`instability_ahead` (which statistic started to grow first, and what usually stops it) and the `exception` of a step
that raised between steps (the user's line, the samples recorded last). replay/judge/precursor.py and
replay/judge/between_steps.py build the rest of those reports; the words are here, beside the other verdicts'
(verdict_words.py), and go into the report's typed Verdict through the same `verdict_of`.
"""

from __future__ import annotations

from typing import Any

from forensics.core.headroom import HORIZON, Limit, percent_of
from forensics.core.kinds import Phase, PrecursorRule, PrecursorStatistic, StateHolds, VerdictKind
from forensics.report.tree import Verdict
from forensics.report.wording import clean, fmt_id, fmt_num
from forensics.replay.judge.verdict_words import verdict_of

GENERAL_FIXES = (
    "lower the peak learning rate or lengthen the warm-up: several layers' statistics grow together "
    "when the step size outruns the curvature",
)
MAX_NAMED = 8  # sample ids named in a between-steps verdict (report.json's exception block lists more)


def instability_ahead(
    step: int, ranking: list[dict], fired: dict | None, columns: int, local: bool = True, limit: Limit | None = None
) -> Verdict:
    """The verdict of a precursor dump.

    Args:
        step: the dumped step.
        ranking: the statistics that left their baseline, earliest first (replay/judge/precursor.rank_growth).
        fired: the job's firing this dump was made for (a `precursors.json` firing), or None.
        columns: how many (layer, statistic) series the job recorded.
        local: this rank's own statistics fired (False: another rank's did, and every rank dumped).
        limit: the dtype's limit of the fired statistic, when its rule is one of the limit's (headroom, trend,
            overflow): the headline is then that limit, and the ranking explains how it got there.
    """
    fired_statistic = _statistic((fired or {}).get("statistic"))
    if not ranking and not local:  # dumped because another rank's statistics grew (a sharded state: all ranks dump)
        headline = (
            f"Instability ahead at step {step}, seen by another rank: this rank's statistics did not leave "
            "their baseline. Replay the rank that saw it (`forensics replay` of the step directory picks the "
            "rank whose trigger is local)."
        )
        explanation = (
            "Every rank dumped this step together because one rank's per-layer statistics kept growing; "
            "each rank measures its own micro-batches and parameter shards."
        )
        fixes = []
    elif ranking:
        first = ranking[0]
        stat = PrecursorStatistic(first["statistic"])
        direction = "grow" if stat.rising else "fall"
        headline = (
            f"Instability ahead at step {step}: the {stat.words} of `{first['layer']}` started to {direction} "
            f"first, at step {first['started']} ({fmt_num(first['baseline'])} -> {fmt_num(first['last'])}, "
            f"{fmt_num(first['growth'], 3)}x)."
        )
        others = [f"{r['words']} of `{r['layer']}` (from step {r['started']})" for r in ranking[1:4]]
        explanation = (
            f"{len(ranking)} of {columns} per-layer statistics left their baseline and stayed out"
            + (f"; next: {'; '.join(others)}" if others else "")
            + ". The job was still healthy when this "
            "was dumped: nothing was replayed. The dump holds the step's pre-step state, so `forensics "
            "replay` of a later crash dump and this one can be compared."
        )
        fixes = [PrecursorStatistic(r["statistic"]).usual_fix for r in ranking[:4]]
    else:
        what = f"the {fired['statistic']} of `{fired['layer']}`" if fired else "a per-layer statistic"
        headline = (
            f"Instability ahead at step {step}: {what} grew in the job, but the recorded window is too short "
            "to tell which started first."
        )
        explanation = "The statistics in the dump do not show a sustained growth from a baseline."
        fixes = [fired_statistic.usual_fix] if fired_statistic is not None else []
    if fired is not None and fired_statistic is not None and limit is not None:
        headline = _limit_headline(step, fired, fired_statistic, limit) or headline
    return verdict_of(VerdictKind.INSTABILITY_AHEAD, headline, explanation, fixes + list(GENERAL_FIXES))


def _limit_headline(step: int, fired: dict, stat: PrecursorStatistic, limit: Limit) -> str | None:
    """The headline of a precursor fired by its dtype's limit (headroom, trend, overflow), from the numbers and the
    limit the column's dtype sets (never from text in the dump); None for a firing of the growth rule."""
    rule = PrecursorRule.parse(fired.get("rule"), PrecursorRule.GROWTH)
    if rule is PrecursorRule.GROWTH:
        return None
    what = f"the {stat.words} of `{fired['layer']}`"
    value = fired.get("value")
    if rule is PrecursorRule.NONFINITE or not isinstance(value, (int, float)):
        return f"Instability ahead at step {step}: {what} overflowed ({limit.words}) while the loss was still finite."
    if rule is PrecursorRule.HEADROOM:
        return (
            f"Instability ahead at step {step}: {what} reached {fmt_num(value)}, {percent_of(value, limit.value)} "
            f"of {limit.words}."
        )
    return (
        f"Instability ahead at step {step}: {what} is climbing steadily toward {limit.words}: "
        f"{fmt_num(value)} ({percent_of(value, limit.value)}), on course to reach it within "
        f"{HORIZON} steps."
    )


def _statistic(value: Any) -> PrecursorStatistic | None:
    return next((s for s in PrecursorStatistic if s.value == value), None)


def exception_between_steps(
    exception: dict, dumped_step: int, last_step: int | None, ids: list, state_holds: StateHolds
) -> Verdict:
    """The verdict of a step that raised between steps (data loading or other user code after the update).

    Args:
        exception: the manifest's `exception` (type, message, user_frame): text from the dump, cleaned here.
        dumped_step: the step the dump is filed under.
        last_step: the step whose samples were recorded last (replay/judge/between_steps.last_samples), or None.
        ids: those samples' ids.
        state_holds: which weights the dump holds (after the last update, or the pre-step state).
    """
    what = clean(str(exception.get("type") or "an exception"), 100)
    frame = exception.get("user_frame") or {}
    where = (
        f" at {clean(str(frame.get('file')), 200)}:{frame.get('line')} in {clean(str(frame.get('function')), 100)}"
        if frame.get("file")
        else ""
    )
    code = f" (`{clean(str(frame['code']), 200)}`)" if frame.get("code") else ""
    message = clean(str(exception.get("message") or ""), 200)
    headline = f"{what} raised {Phase.BETWEEN_STEPS.words}{where}{code}, before step {dumped_step} began" + (
        f": {message}." if message else "."
    )
    named = ", ".join(fmt_id(i) for i in ids[:MAX_NAMED]) + (
        f" and {len(ids) - MAX_NAMED} more" if len(ids) > MAX_NAMED else ""
    )
    samples = (
        f"The last samples recorded were those of step {last_step}: {named}. "
        if ids
        else "No sample of the step was recorded. "
    )
    state = {
        StateHolds.AFTER_UPDATE: f"The dump holds the weights after step {dumped_step - 1}'s update, which are "
        f"step {dumped_step}'s pre-step state.",
        StateHolds.PRE_STEP: f"No optimizer update ran after step {dumped_step}'s check; the dump holds its "
        "pre-step state.",
    }.get(state_holds, "")
    explanation = (
        f"The model's forward, backward and update had finished; the exception came from the training "
        f"loop's own code, so there is no model step to replay and nothing was re-run. {samples}{state}"
    )
    suggestions = [
        f"Fix the code{where or ' the traceback names'}: the traceback in report.json (exception.traceback) "
        "shows the call chain.",
        (
            "If the data loader raised on a record, look up the samples it was about to load after the last "
            f"recorded ones (step {last_step}'s: {named}), and filter or repair that record."
            if ids
            else "If the data loader raised on a record, the loader's own position (its sampler, the step count) "
            "says which records came next: no sample IDs were recorded to start from. Filter or repair that "
            "record."
        ),
    ]
    return verdict_of(VerdictKind.EXCEPTION, headline, explanation.strip(), suggestions)


__all__ = ["GENERAL_FIXES", "MAX_NAMED", "exception_between_steps", "instability_ahead"]
