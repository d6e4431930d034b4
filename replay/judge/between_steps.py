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

from forensics.core.kinds import FidelityMode, Phase, StateHolds, TriggerKind
from forensics.report.model import schema_for, to_json_safe
from forensics.report.tree import (
    Culprit,
    DumpInfo,
    Environment,
    ExceptionBlock,
    Fidelity,
    History,
    Report,
    Stats,
    Timings,
    TriggerBlock,
)
from forensics.core.trigger import Trigger
from forensics.replay.judge.findings import HistoryFinding
from forensics.replay.judge.verdict_unreplayed import exception_between_steps
from forensics.replay.load.environment import replay_environment

MAX_LISTED = 256  # sample ids report.json's exception block keeps (the verdict names up to its MAX_NAMED)


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
    verdict = exception_between_steps(exception, dump.step, step, ids, holds)
    return Report.built(
        schema=schema_for(str(verdict.kind)),
        created_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        dump=DumpInfo.parse(to_json_safe({"num_micro_batches": dump.num_micro_batches, **dump_info})),
        trigger=TriggerBlock.of(Trigger(TriggerKind.EXCEPTION, detail=dump.trigger.detail)),
        environment=Environment.parse(
            to_json_safe(
                {
                    "capture": dump.manifest.get("environment"),  # kept as the manifest has it, null included
                    "replay": replay_environment(torch.device("cpu")),
                    "warnings": [],
                }
            )
        ),
        reproduced=False,
        fidelity=Fidelity.built(
            mode=FidelityMode.NOT_REPLAYED.value,
            reason="the exception was raised between steps, outside the model's step: there is no step to replay",
            attempts=0,
        ),
        verdict=verdict,
        culprit=Culprit(samples=[], phase=Phase.BETWEEN_STEPS.value, stats=Stats.built()),
        history=History.parse(to_json_safe(history.block)) if history.block is not None else None,
        history_pattern=history.pattern.value,
        timings=Timings(total_s=round(time.monotonic() - started, 3), passes=0),
        exception=ExceptionBlock.parse(
            to_json_safe(
                {
                    "type": exception.get("type"),
                    "message": exception.get("message"),
                    "during": exception.get("during"),
                    "user_frame": exception.get("user_frame"),
                    "state_holds": exception.get("state_holds"),
                    "last_samples": {"step": step, "sample_ids": ids[:MAX_LISTED]},
                    "traceback": exception.get("traceback"),
                }
            )
        ),
    )
