"""The check a step gets: the sync-free one (capture/detection/sync_free.py) where DetectionConfig.sync_free and the
optimizer allow it (by default: where the dumps stay exact), else the synchronous one (capture/detection/sync.py).

Either way a check only reports: it yields the Incidents the Guard then dumps and applies its policy to.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator

from forensics.capture.detection.detectors import StepDetectors
from forensics.capture.detection.sync import SyncCheck
from forensics.capture.detection.sync_free import SyncFree
from forensics.capture.config import GuardConfig
from forensics.capture.precursors.monitor import PrecursorMonitor
from forensics.capture.recording.history import History
from forensics.capture.recording.incident import Incident, StepRecord
from forensics.capture.recording.window import FlightRecorder
from forensics.capture.state.host_snapshots import HostSnapshots
from forensics.capture.state.source import StateSource
from forensics.core.errors import TrainingFaultError

log = logging.getLogger(__name__)


class StepCheck:
    """Runs the step's check in the mode the configuration and the optimizer allow.

    Args:
        config, state, history, window, snapshots, precursors: what the checks read and feed (capture/detection/sync.py);
            the detectors (StepDetectors) are the check's own.
        spike_floor: the dump budget's DumpBudget.spike_floor (the sync-free check asks it before a step's update).
        add_hook: keeps the optimizer hook the sync-free mode installs (the Guard removes it at close()).
    """

    def __init__(
        self,
        config: GuardConfig,
        state: StateSource,
        history: History,
        window: FlightRecorder,
        snapshots: HostSnapshots,
        precursors: PrecursorMonitor | None,
        spike_floor: Callable[[int], float | None],
        add_hook: Callable[[Any], None],
    ):
        self.detectors = StepDetectors(config)
        self.sync = SyncCheck(config, self.detectors, state, history, window, snapshots, precursors)
        self.sync_free = (
            None
            if config.detection.sync_free is False
            else SyncFree(config, self.detectors, state, history, window, spike_floor, add_hook)
        )

    def incidents(self, record: StepRecord, grad_norm: Any, step: int, sync_free: bool) -> Iterable[Incident]:
        """The Incidents of this check of `step` (none on a healthy step: the hot path makes no generator).
        Sync-free: the previous step's (judged now); this step's copies start only once the caller has handled it,
        so a TrainingFaultError raised for it leaves this step unstarted, as the synchronous mode leaves its step
        unapplied."""
        if sync_free:
            return self._sync_free_incidents(record, grad_norm, step)
        incident = self.sync.check(record, grad_norm, step)
        return () if incident is None else (incident,)

    def _sync_free_incidents(self, record: StepRecord, grad_norm: Any, step: int) -> Iterator[Incident]:
        deferred = self.sync_free
        if deferred is None:  # sync_free is checked active first
            return
        incident = deferred.resolve(step)
        if incident is not None:
            yield incident
        if deferred.active():
            deferred.start(record, grad_norm, step)
            return
        incident = self.sync.check(record, grad_norm, step)  # the judgment just turned the check synchronous
        if incident is not None:
            yield incident

    def flush(self, step: int, report: Callable[[Incident], Any]) -> None:
        """Sync-free: judges the step still waiting (Guard.flush / close) and `report`s its Incident, if it failed.
        A TrainingFaultError from `report` goes on; a failure inside forensics is logged."""
        try:
            incident = self.sync_free.resolve(step) if self.sync_free is not None else None
            if incident is not None:
                report(incident)
        except TrainingFaultError:
            raise
        except Exception:
            log.exception("forensics: judging the last step failed inside forensics")

    def device_lost(self) -> None:
        """The CUDA context is unusable: sync-free buffers the device may still write into are never reused."""
        if self.sync_free is not None:
            self.sync_free.quarantine()
