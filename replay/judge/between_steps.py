"""The report of a step that raised between steps (data loading or other user code after the optimizer update).

There is no model step to replay: the job's forward, backward and update had all finished (or no update ran
after the check), and what raised is the loop's own code. So nothing is loaded, imported or re-run (no
--trust needed); the verdict names the exception, the line of the user's code it came from (manifest
`exception.user_frame`) and the samples recorded last, and says why no replay was made.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

import torch

from forensics.core.kinds import FidelityMode, Phase, StateHolds, TriggerKind, VerdictKind
from forensics.report.model import schema_for, to_json_safe
from forensics.report.tree import Report, TriggerBlock, parse_report
from forensics.core.trigger import Trigger
from forensics.report.wording import clean, fmt_id
from forensics.replay.judge.findings import HistoryFinding
from forensics.replay.load.environment import replay_environment

MAX_NAMED = 8  # sample ids named in the explanation (report.json's exception block keeps up to MAX_LISTED)
MAX_LISTED = 256


def raised_between_steps(manifest: dict) -> bool:
    """The dump's exception was raised outside the model step (manifest `exception.during`)."""
    exception = manifest.get("exception")
    return isinstance(exception, dict) and exception.get("during") == Phase.BETWEEN_STEPS.value


def last_samples(dump: Any) -> tuple[int | None, list]:
    """(step, sample ids) of the last micro-batches the Guard recorded: the dump's own (no update ran after the
    check) or the flight recorder's last step (the update ran, so the dump holds none of the next step)."""
    if dump.num_micro_batches:
        return dump.step, [i for index in range(dump.num_micro_batches) for i in dump.sample_ids(index) or []]
    rows = dump.window()
    if not rows:
        return None, []
    last = rows[-1]
    return last["step"], [i for ids in last["sample_ids"] for i in ids or []]


def between_steps_report(dump: Any, dump_info: dict, history: HistoryFinding, started: float) -> Report:
    """The report (docs/REPORT_FORMAT.md) of a dump raised between steps; nothing is replayed."""
    exception = dump.manifest["exception"]
    step, ids = last_samples(dump)
    holds = StateHolds.parse(exception.get("state_holds"), StateHolds.MAYBE_PARTIAL)
    verdict = _between_steps_verdict(exception, dump.step, step, ids, holds)
    report = {
        "schema": schema_for(VerdictKind.EXCEPTION),
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "dump": {"num_micro_batches": dump.num_micro_batches, **dump_info},
        "trigger": TriggerBlock.of(Trigger(TriggerKind.EXCEPTION, detail=dump.trigger.detail)).as_dict(),
        "environment": {
            "capture": dump.manifest.get("environment"),
            "replay": replay_environment(torch.device("cpu")),
            "warnings": [],
        },
        "reproduced": False,
        "fidelity": {
            "mode": FidelityMode.NOT_REPLAYED.value,
            "reason": "the exception was raised between steps, outside the model's step: there is no step to replay",
            "attempts": 0,
        },
        "verdict": verdict,
        "culprit": {
            "samples": [],
            "module": None,
            "op": None,
            "phase": Phase.BETWEEN_STEPS.value,
            "parameter": None,
            "optimizer_state": None,
            "stats": {},
            "traceback": None,
        },
        "history": history.block,
        "history_pattern": history.pattern.value,
        "timings": {"total_s": round(time.monotonic() - started, 3), "passes": 0},
        "exception": {
            "type": exception.get("type"),
            "message": exception.get("message"),
            "during": exception.get("during"),
            "user_frame": exception.get("user_frame"),
            "state_holds": exception.get("state_holds"),
            "last_samples": {"step": step, "sample_ids": ids[:MAX_LISTED]},
            "traceback": exception.get("traceback"),
        },
    }
    return parse_report(to_json_safe(report))


def _between_steps_verdict(
    exception: dict, dumped_step: int, last_step: int | None, ids: list, state_holds: StateHolds
) -> dict:
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
    return {
        "kind": VerdictKind.EXCEPTION.value,
        "headline": headline,
        "explanation": explanation.strip(),
        "suggestions": suggestions,
    }
