"""What the Guard records when a step raises instead of finishing: the exception, where in the step it
happened, and (for out-of-memory errors) the memory picture, before anything is freed.

Written as the manifest's `exception` section (docs/DUMP_FORMAT.md). Every function here must work
while the job is failing: none raises, and none touches a CUDA context that may be broken beyond
reading memory counters.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import sysconfig
import traceback
import weakref
from typing import Any, Protocol

import torch

from forensics.capture.detection.sync import host_numbers
from forensics.core.fsio import our_code_directories
from forensics.capture.raised.optimizer_steps import AfterCheck, OptimizerSteps
from forensics.capture.recording.incident import Incident, StepRecord
from forensics.capture.recording.misuse import CheckCalls
from forensics.capture.state.host_snapshots import available_host_memory, proc_bytes
from forensics.capture.state.source import StateSource
from forensics.core.errors import TrainingFaultError, is_out_of_memory
from forensics.format.batch_tree import tensor_leaves
from forensics.core.kinds import Phase, Policy, StateHolds, TriggerKind
from forensics.core.trigger import Trigger

log = logging.getLogger(__name__)

MAX_FRAMES = 40
MAX_MESSAGE = 4000


def exception_section(exc: BaseException, during: Phase, batches: list[Any]) -> dict:
    """The manifest's `exception` section for `exc`, raised `during` the forward, backward, optimizer step or
    between steps."""
    frames = traceback.extract_tb(exc.__traceback__)[-MAX_FRAMES:]
    cls = type(exc)
    section = {
        "type": cls.__name__,
        "qualified_type": f"{cls.__module__}.{cls.__qualname__}",
        "message": _safe_str(exc)[:MAX_MESSAGE],
        "during": Phase(during).value,
        "frames": [{"file": f.filename, "line": f.lineno, "function": f.name} for f in frames],
        "user_frame": user_frame(frames),
        "traceback": "".join(traceback.format_exception(cls, exc, exc.__traceback__))[-20000:],
        "cuda_error": is_cuda_error(exc),
        "peer_failure": peer_failure(exc),
    }
    if _is_oom(exc):
        section["memory"] = memory_picture(batches)
    return section


NOT_USER_CODE = tuple(
    p + os.sep
    for p in (
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
        os.path.dirname(os.path.abspath(torch.__file__)),
        *(d.rstrip(os.sep) for d in our_code_directories()),
    )
)


def user_frame(frames: list[traceback.FrameSummary]) -> dict | None:
    """The innermost frame of the user's own code (not the standard library, an installed package or
    forensics): where their loop raised, e.g. the line of train.py that builds the batch."""
    for index in range(len(frames) - 1, -1, -1):
        frame = frames[index]
        if frame.filename.startswith("<") or os.path.abspath(frame.filename).startswith(NOT_USER_CODE):
            continue
        function = frame.name
        for outer in reversed(frames[:index]):  # a comprehension's frame: name the function it is written in
            if not function.startswith("<") or outer.filename != frame.filename:
                break
            function = outer.name
        return {"file": frame.filename, "line": frame.lineno, "function": function, "code": frame.line or ""}
    return None


def during_words(during: Phase) -> str:
    """'during the forward pass', 'between steps (data loading or user code)': where a step raised, in words."""
    return f"during {during.words}" if during.in_model_step else during.words


def memory_picture(batches: list[Any]) -> dict:
    """Allocated / reserved device memory, and each micro-batch's tensor shapes and bytes (what made it big)."""
    picture: dict[str, Any] = {"micro_batches": []}
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            picture.update(
                device=device,
                allocated=torch.cuda.memory_allocated(device),
                reserved=torch.cuda.memory_reserved(device),
                max_allocated=torch.cuda.max_memory_allocated(device),
                total=torch.cuda.get_device_properties(device).total_memory,
            )
    except Exception:  # noqa: BLE001 - a broken context: the counters are a bonus
        pass
    picture["host"] = {"rss": proc_bytes("/proc/self/status", "VmRSS:"), "available": available_host_memory()}
    for index, batch in enumerate(batches):
        tensors = list(tensor_leaves(batch))
        picture["micro_batches"].append(
            {
                "index": index,
                "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
                "shapes": {path or "batch": list(t.shape) for path, t in tensors[:32]},
            }
        )
    return picture


def first_sight(exc: BaseException) -> bool:
    """True the first time a Guard sees `exc` (then marks it): a TrainingFaultError was dumped by check(), and an
    exception an inner capture_errors() recorded is not dumped again by an outer one or by the excepthook."""
    if isinstance(exc, TrainingFaultError) or getattr(exc, "_forensics_recorded", False):
        return False
    try:
        exc._forensics_recorded = True  # type: ignore[attr-defined]  # a mark on the exception object itself
    except AttributeError:
        pass
    return True


def raised_incident(
    exc: BaseException,
    current: StepRecord | None,
    step: int,
    calls: CheckCalls,
    optimizer_steps: OptimizerSteps,
    state: StateSource,
) -> Incident | None:
    """The Incident of the step that raised `exc` (Guard.record_exception dumps it), or None when there is nothing
    to dump. The step is `current`, the step in progress (number `step`), or — raised after check(), `current`
    None — the step last checked (`calls.last_step`), or the next one's pre-step state when the update had finished
    (the loop's own code raised between steps: `optimizer_steps` tells). `calls.stopped`: the TrainingFaultError
    check() raised last, if the job goes on after it. `state`: whether reading the state is a collective; its
    buffers and configuration."""
    last_step, stopped = calls.last_step, calls.stopped
    if not first_sight(exc):
        return None  # already dumped by check(), or by an outer capture_errors() / the excepthook
    if current is None and stopped is not None:
        log.warning(
            "forensics: %s raised after the Guard stopped the job at step %d (TrainingFaultError): not a "
            "step of the training loop, not dumped (that step's dump: %s)",
            type(exc).__name__,
            step - 1,
            stopped.dump_path or stopped.dump_error,
        )
        return None
    where = optimizer_steps.after_check() if current is None else None
    record = current if current is not None else last_step
    if record is None or not record.batches:
        log.warning(
            "forensics: %s raised outside a recorded step (%s): nothing to dump. To have such code dumped "
            "(evaluation, a data check), record its batch and wrap it: `with guard.capture_errors(): "
            "guard.record_batch(batch); ...` — the step is then dumped where it raises",
            type(exc).__name__,
            "before the first record_batch" if last_step is None else "the steps so far recorded no batch",
        )
        return None
    multi_rank = state.ranks.multi_rank
    if state.is_collective and multi_rank:
        log.error(
            "forensics: step %d raised %s on rank %d; its ZeRO-sharded state cannot be gathered by one "
            "rank alone, so it is not dumped (the micro-batches are in the traceback's frames)",
            step,
            type(exc).__name__,
            state.ranks.rank,
        )
        return None
    if where is not None and where.state_holds is StateHolds.AFTER_UPDATE:
        state.buffers.take_before_forward()  # the next step's pre-step buffers are the ones now
    incident = step_incident(
        exc,
        record,
        step if current is not None else step - 1,
        where,
        multi_rank,
        record.divisor(state.config.detection.loss_divisor),
    )
    if incident.trigger.kind is TriggerKind.EXCEPTION and last_step is not None:
        incident.accumulation = max(len(incident.record.batches), len(last_step.batches))
    log.error(
        "forensics: step %d rank %d raised %s; dumping the step",
        incident.step,
        state.ranks.rank,
        incident.trigger.message,
    )
    return incident


def step_incident(
    exc: BaseException, record: StepRecord, step: int, after_check: AfterCheck | None, multi_rank: bool, divisor: float
) -> Incident:
    """The Incident of a step that raised `exc`: where (forward while micro-batches still lack their loss,
    backward; after check(), `after_check`: the optimizer update or between steps), the `exception` section, and
    a trigger that is not this rank's own when it only saw another rank stop. Raised between steps after the
    update, the dump is of step `step` + 1 (its pre-step state) with none of its micro-batches."""
    if after_check is not None:
        during, holds = after_check.phase, after_check.state_holds
    else:
        during = Phase.BACKWARD if len(record.losses) >= len(record.batches) else Phase.FORWARD
        holds = StateHolds.PRE_STEP
    step += holds.step_offset
    if holds is StateHolds.AFTER_UPDATE:
        record = StepRecord()
    section = exception_section(exc, during, record.batches)
    section["state_may_be_partial"] = holds is StateHolds.MAYBE_PARTIAL
    section["state_holds"] = holds.value
    index = len(record.batches) - 1 if during is Phase.FORWARD else None
    if multi_rank and section["peer_failure"]:  # this rank only saw another rank stop
        trigger = Trigger(
            TriggerKind.EXCEPTION,
            math.nan,
            None,
            index,
            f"another rank stopped: a collective failed {during_words(during)} ({section['type']})",
            local=False,
        )
    else:
        trigger = Trigger(
            TriggerKind.EXCEPTION,
            math.nan,
            None,
            index,
            f"{section['type']} {during_words(during)}: {section['message'][:300]}",
        )
    try:
        host_losses, _ = host_numbers(list(record.losses))
    except Exception:  # noqa: BLE001 - a broken device: the losses are a bonus
        host_losses = [v if isinstance(v, float) else None for v in record.losses]
    losses = [v if isinstance(v, float) else math.nan for v in host_losses]
    return Incident(trigger, step, record, losses, None, divisor, Policy.RAISE, exception=section)


PEER_FAILURE_WORDS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker",
    "NCCL error",
    "ProcessGroup",
    "gloo",
    "Watchdog caught collective operation timeout",
)


def peer_failure(exc: BaseException) -> bool:
    """The exception is a collective failing because another rank stopped (gloo / NCCL), not this rank's own."""
    text = _safe_str(exc)
    return any(word in text for word in PEER_FAILURE_WORDS)


def _is_oom(exc: BaseException) -> bool:
    oom: Any = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(exc, oom) or (
        isinstance(exc, (RuntimeError, MemoryError)) and is_out_of_memory(type(exc).__name__, _safe_str(exc))
    )


def is_cuda_error(exc: BaseException) -> bool:
    """A CUDA error (device-side assert, illegal address ...): the context is unusable from here on."""
    text = _safe_str(exc)
    return "CUDA error" in text or "device-side assert" in text or type(exc).__name__ == "AcceleratorError"


def nccl_watchdog_aborts_on_cuda_errors() -> bool:
    """True when this job's NCCL watchdog will abort the process on a CUDA error (PyTorch's default,
    TORCH_NCCL_RETHROW_CUDA_ERRORS unset or 1): a device-side assert then ends the rank from the watchdog thread,
    typically within 0.1 s, racing the dump of the step that raised (seen on 2 H100s, 2026-11-26)."""
    try:
        import torch.distributed as dist

        nccl = dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend())
    except Exception:  # noqa: BLE001 - no process group: no watchdog
        return False
    return nccl and os.environ.get("TORCH_NCCL_RETHROW_CUDA_ERRORS", "1") != "0"


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001
        return f"<{type(exc).__name__} without a message>"


# -- the one excepthook: uncaught exceptions reach every live Guard -------------------------------
class RecordsExceptions(Protocol):
    """What the excepthook needs of a Guard."""

    def record_exception(self, exc: BaseException) -> Any: ...


_WATCHED: "weakref.WeakSet[RecordsExceptions]" = weakref.WeakSet()
_PREVIOUS: list[Any] = []


def _excepthook(exc_type, exc, tb) -> None:
    if isinstance(exc, Exception):
        for recorder in list(_WATCHED):
            recorder.record_exception(exc)  # never raises; a Guard dumps only a step in progress
    (_PREVIOUS[0] if _PREVIOUS else sys.__excepthook__)(exc_type, exc, tb)


def watch(recorder: RecordsExceptions) -> None:
    """Has uncaught exceptions go to `recorder.record_exception` (a Guard: it dumps its step in progress). One hook
    for every Guard of the process, chained to the previous one, holding them weakly (a Guard that is dropped is not
    kept alive)."""
    if nccl_watchdog_aborts_on_cuda_errors():
        log.warning(
            "forensics: NCCL's watchdog aborts this process on a CUDA error (a device-side assert), which can "
            "end the rank before its dump is written; to let the dump finish and the job fail with its own "
            "exception, set TORCH_NCCL_RETHROW_CUDA_ERRORS=0 before init_process_group (docs/INTEGRATIONS.md)"
        )
    if sys.excepthook is not _excepthook:
        _PREVIOUS[:] = [sys.excepthook]
        sys.excepthook = _excepthook
    _WATCHED.add(recorder)


def unwatch(recorder: RecordsExceptions) -> None:
    """Guard.close(): this Guard no longer dumps uncaught exceptions; the hook goes once none is watched."""
    _WATCHED.discard(recorder)
    if not _WATCHED and sys.excepthook is _excepthook:
        sys.excepthook = _PREVIOUS[0] if _PREVIOUS else sys.__excepthook__
