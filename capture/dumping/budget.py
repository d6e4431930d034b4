"""How many dumps a run may write, by kind, so that spikes never starve the crash (GuardConfig.dumping.max_dumps,
max_spike_dumps, min_spike_gap).

Three budgets that never borrow from each other:

* faults — a non-finite loss / gradient / weight, a step that raised, a device error: `max_dumps` slots, used by
  nothing else. A spiky run that ends in a NaN always has a slot left for the NaN.
* spikes — finite loss and grad-norm spikes: at most `max_spike_dumps` on disk. The first spike of the run is always
  kept (where the trouble started); the others are the largest so far: a spike larger than the smallest one kept
  replaces it (the new dump is written, then the old one is deleted with its step directory when that is left
  empty). Size is how far the value went over its threshold (value / threshold), comparable between loss and
  grad-norm spikes. `min_spike_gap` still spaces spike dumps, so one unstable phase is not written step after step.
* precursors — counted by the precursor monitor itself (PrecursorConfig.max_dumps); no slot here.

Every decision depends only on the step and the trigger's value and threshold, which the detectors compute from
values agreed across ranks (capture/detection/agreement.py): every rank takes the same decision at the same step, so a
collective dump never waits on a rank that declined. One process gives a slot back when its write fails; several
ranks do not (failures are not identical on every rank).

What was not dumped is counted by kind and reason (`NotDumped`): logged once when it starts and then once per
LOG_EVERY_STEPS steps with a count (never once per step), and written in every later dump's manifest
(`dump_budget`, docs/DUMP_FORMAT.md).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field

from forensics.capture.config import DumpConfig
from forensics.core.kinds import TriggerKind

log = logging.getLogger(__name__)

LOG_EVERY_STEPS = 100  # at most one line per this many steps about triggers that were not dumped


@dataclass
class _Kept:
    """A spike dump the budget keeps: its step and size (value / threshold)."""

    step: int
    size: float


@dataclass
class Admission:
    """The budget's answer for one incident: `why_not` None means dump it; `replaces` is the spike dump to delete
    once the new one is written."""

    why_not: str | None = None
    reason: str = ""
    """The short key a refusal is counted under (the manifest's `dump_budget.not_dumped`)."""
    replaces: _Kept | None = None
    spike: _Kept | None = None


@dataclass
class NotDumped:
    """Triggers that were not dumped, by kind and reason, and the log lines about them (LOG_EVERY_STEPS)."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    _pending: int = 0
    _pending_since: int | None = None
    _last_logged: int | None = None
    _largest: tuple[float, int, str] | None = None

    def note(self, kind: TriggerKind, step: int, why: str, reason: str, message: str, size: float | None) -> None:
        """Counts one trigger of `kind` at `step` not dumped because `why` (`reason`: its short key)."""
        by_reason = self.counts.setdefault(kind.value, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        if self._last_logged is None or step - self._last_logged >= LOG_EVERY_STEPS:
            self.flush(step)
            self._last_logged = step
            log.warning(
                "forensics: step %d: %s; not dumped: %s. Further triggers that are not dumped are counted "
                "and logged at most once per %d steps (the counts go into every later dump's manifest, "
                "`dump_budget`).",
                step,
                message,
                why,
                LOG_EVERY_STEPS,
            )
            return
        self._pending += 1
        self._pending_since = step if self._pending_since is None else self._pending_since
        if size is not None and (self._largest is None or size > self._largest[0]):
            self._largest = (size, step, message)

    def flush(self, step: int | None = None) -> None:
        """Logs the count of triggers not dumped since the last line (at the next window, and at close())."""
        if not self._pending:
            return
        largest = f"; the largest at step {self._largest[1]}: {self._largest[2]}" if self._largest else ""
        log.warning(
            "forensics: %d more trigger(s) in steps %d-%s were not dumped (dump budget: %s)%s",
            self._pending,
            self._pending_since,
            step if step is not None else "end",
            self.words(),
            largest,
        )
        self._pending, self._pending_since, self._largest = 0, None, None

    def total(self) -> int:
        return sum(sum(reasons.values()) for reasons in self.counts.values())

    def words(self) -> str:
        """'12 loss_spike (9 min_spike_gap, 3 smaller), 1 precursor (...)' for the log."""
        return (
            ", ".join(
                f"{sum(r.values())} {kind} ({', '.join(f'{n} {why}' for why, n in r.items())})"
                for kind, r in self.counts.items()
            )
            or "none"
        )


class DumpBudget:
    """The run's three dump budgets (module docstring). Thread-safe: a background write reports back from its
    thread."""

    def __init__(self, dumping: DumpConfig):
        self.dumping = dumping  # GuardConfig.dumping
        self._faults = threading.Semaphore(dumping.max_dumps)
        self._lock = threading.Lock()
        self._first_spike: _Kept | None = None
        self._largest: list[_Kept] = []
        self._last_spike_step: int | None = None
        self.not_dumped = NotDumped()

    def admit(self, kind: TriggerKind, step: int, value: float | None, threshold: float | None) -> Admission:
        """Whether a trigger of `kind` at `step` is dumped (a fault takes a slot; a spike gets its place)."""
        dumping = self.dumping
        if kind is TriggerKind.PRECURSOR:
            return Admission()
        if not kind.spike:
            if self._faults.acquire(blocking=False):
                return Admission()
            return Admission(
                f"the {dumping.max_dumps} fault dumps of this run are written (GuardConfig.dumping.max_dumps)",
                "max_dumps",
            )
        with self._lock:
            size = spike_size(value, threshold)
            refusal = self._spike_refusal(step, size)
            if refusal is not None:
                return refusal
            kept = _Kept(step, size)
            self._last_spike_step = step
            if self._first_spike is None:
                self._first_spike = kept
            elif len(self._largest) + 1 < dumping.max_spike_dumps:
                self._largest.append(kept)
            else:
                smallest = min(self._largest, key=lambda k: k.size)  # _spike_refusal: there is one, and smaller
                self._largest.remove(smallest)
                self._largest.append(kept)
                return Admission(replaces=smallest, spike=kept)
            return Admission(spike=kept)

    def spike_floor(self, step: int) -> float | None:
        """The size (value / threshold: spike_size) a spike at `step` must exceed to be dumped; -inf: any spike is,
        None: none is (min_spike_gap, spike dumps off). Changes nothing: the sync-free check asks before the step's
        update, on the device, whether a spike would be dumped (capture/detection/sync_free.py), and admit() answers the
        same at that step when nothing was admitted in between."""
        with self._lock:
            if self._spike_refusal(step, math.inf) is not None:
                return None
            if self._spike_refusal(step, -math.inf) is None:
                return -math.inf
            return min(k.size for k in self._largest)

    def _spike_refusal(self, step: int, size: float) -> Admission | None:
        """Why a spike of `size` at `step` is not dumped (None: it is). Call with the lock held; changes nothing."""
        dumping = self.dumping
        last = self._last_spike_step
        if last is not None and step - last < dumping.min_spike_gap:
            return Admission(
                f"a spike was dumped {step - last} steps ago (GuardConfig.dumping.min_spike_gap)", "min_spike_gap"
            )
        if dumping.max_spike_dumps == 0:
            return Admission("spike dumps are off (GuardConfig.dumping.max_spike_dumps=0)", "off")
        if self._first_spike is None or len(self._largest) + 1 < dumping.max_spike_dumps:
            return None
        smallest = min(self._largest, key=lambda k: k.size, default=None)
        if smallest is None or size <= smallest.size:
            return Admission(
                f"it is not larger than the {dumping.max_spike_dumps} spike dumps kept (the first and "
                "the largest; GuardConfig.dumping.max_spike_dumps)",
                "smaller_than_kept",
            )
        return None

    def failed(self, kind: TriggerKind, admission: Admission, multi_rank: bool) -> None:
        """The write failed: one process gives the place back (several ranks keep it: module docstring)."""
        if multi_rank:
            return
        if not kind.spike and kind is not TriggerKind.PRECURSOR:
            self._faults.release()
            return
        with self._lock:
            spike = admission.spike
            if spike is None:
                return
            if spike is self._first_spike:
                self._first_spike = None
            elif spike in self._largest:
                self._largest.remove(spike)
                if admission.replaces is not None:  # the one it was to replace is still on disk: keep it
                    self._largest.append(admission.replaces)

    def manifest(self) -> dict:
        """The manifest's `dump_budget` section (docs/DUMP_FORMAT.md): the budgets and what was not dumped."""
        with self._lock:
            kept = [k.step for k in ([self._first_spike] if self._first_spike else []) + self._largest]
        return {
            "max_dumps": self.dumping.max_dumps,
            "max_spike_dumps": self.dumping.max_spike_dumps,
            "min_spike_gap": self.dumping.min_spike_gap,
            "spike_dumps_kept": sorted(kept),
            "not_dumped": {kind: dict(reasons) for kind, reasons in self.not_dumped.counts.items()},
        }


def spike_size(value: float | None, threshold: float | None) -> float:
    """How far a spike went over its threshold (value / threshold; the value itself without a positive threshold)."""
    if value is None:
        return 0.0
    if threshold is not None and threshold > 0:
        return value / threshold
    return value
