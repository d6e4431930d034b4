"""The run log: every step's scalars and every event of this rank, written where the dumps go, for `forensics timeline`.

The Guard already brings each step's loss, grad norm, lr, loss scale and clip / skip flags to the host for its
history (recording/history.py); the run log keeps a copy of that row (a list append on the training thread: no device
read, no I/O) and hands whole segments to the dump writer's background thread (dumping/writer_thread.py), which
encodes and writes them: every FLUSH_STEPS steps, FLUSH_S seconds, at each event and when the Guard closes. A
segment file is replaced whole (a temporary file renamed locally; one object in object storage, which has no
append), so a killed job leaves the log as of its last flush. Bounded: the newest FULL_SEGMENTS segments keep each
step; older ones are rewritten thinned to buckets of healthy steps, never losing an event or an anomalous step
(docs/DUMP_FORMAT.md, "Run log"; forensics/format/run_log.py). Nothing is written before the first event (a trigger,
dumped or not): a healthy run writes nothing, and the segments kept until then (a few MB at most) are written
then. Never raises into the job.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Any, Callable

from forensics.format import run_log as fmt
from forensics.format.location import Location, RemotePath, as_location, open_write

log = logging.getLogger(__name__)

FLUSH_STEPS = 256
"""Steps between two flushes (a killed job loses at most these, or FLUSH_S seconds of them)."""
FLUSH_S = 30.0


def log_dir(dump_dir: str | os.PathLike | Location, run_id: str, rank: int) -> Location:
    """Where rank `rank`'s run log of `run_id` goes under the dump directory."""
    return as_location(dump_dir) / fmt.DIR_NAME / run_id / f"rank-{int(rank)}"


class RunLog:
    """One rank's run log.

    Args:
        root: the dump directory (GuardConfig.dump_dir: a directory or an fsspec URL).
        run_id, rank, world_size: the run and this rank.
        background: runs a function on the dump writer's thread (BackgroundWriter.call); None: runs it here.
    """

    def __init__(
        self,
        root: str | os.PathLike | Location,
        run_id: str,
        rank: int,
        world_size: int,
        background: Callable[[Callable[[], None]], None] | None = None,
    ):
        self.directory = log_dir(root, run_id, rank) / f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.header = {"run_id": run_id, "rank": int(rank), "world_size": int(world_size)}
        self.background = background
        self.rows: list[tuple] = []  # the current segment's raw rows (the training thread appends)
        self.events: list[dict] = []
        self.segment = 0
        self.last_step = 0
        self.since_flush = 0
        self.flushed_at = time.monotonic()
        self.closed = False
        self.failed = False
        self.wanted = False  # set at the first event: from then on the log is on disk (a healthy run writes nothing)
        self._held: dict[str, tuple[Location, bytes]] = {}  # the segments' bytes until then (bounded: thinned)
        self._stored: list[list] = []  # the current segment's rows as stored (the writer thread converts each once)
        self._lines: list[str] = []  # ... and as JSON lines
        self._thinning: deque[tuple[int, list, list]] = deque()  # full segments still kept whole on disk
        self._lock = threading.Lock()  # one write at a time (the writer thread, or close() at exit)
        self._mutex = threading.Lock()  # events come from the writer thread too (a dump written)
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- the training thread (the hot path: a tuple appended) ---------------------------------------
    def step(self, *scalars: Any) -> None:
        """History.append's arguments (step, loss, grad_norm, lr, loss_scale, clipped, skipped, suppressed)."""
        if self.closed:
            return
        try:
            self.rows.append(scalars)
            self.last_step = scalars[0]
            self.since_flush += 1
            if len(self.rows) >= fmt.SEGMENT_ROWS:
                self._submit(final=True)
            elif self.since_flush >= FLUSH_STEPS or time.monotonic() - self.flushed_at > FLUSH_S:
                self.flush()
        except Exception:  # noqa: BLE001 - the log must never stop the job
            self._give_up("a step could not be logged")

    def event(self, kind: fmt.EventKind, step: int, **fields: Any) -> None:
        """Notes an event and flushes (an event is what a killed job must not lose)."""
        if self.closed:
            return
        try:
            stored: dict[str, Any] = {"event": kind.value, "step": int(step)}
            stored.update({k: fmt.number(v) if isinstance(v, float) else v for k, v in fields.items() if v is not None})
            with self._mutex:
                self.events.append(stored)
                self.wanted = self.wanted or kind is not fmt.EventKind.END
            self.flush()
        except Exception:  # noqa: BLE001
            self._give_up("an event could not be logged")

    def trigger(self, incident: Any, dumped: bool, why_not: str | None) -> None:
        """A detector's incident (capture/recording/incident.py), dumped or not (`why_not`)."""
        trigger = incident.trigger
        self.event(
            fmt.EventKind.TRIGGER,
            incident.step,
            trigger=trigger.kind.value,
            message=str(trigger.message)[: fmt.MAX_TEXT],
            value=trigger.value,
            threshold=trigger.threshold,
            policy=getattr(incident.policy, "value", None),
            dumped=dumped,
            why_not=None if dumped else (why_not or "not dumped")[: fmt.MAX_TEXT],
            local=bool(trigger.local),
        )

    def flush(self) -> None:
        """Hands the current segment to the writer thread."""
        self._submit(final=False)

    def close(self, budget: dict | None = None) -> None:
        """The Guard closes: the `end` event (the run's dump budget) and the last flush, written here."""
        if self.closed:
            return
        self.background = None  # written on this thread from now on (the writer thread has ended)
        if budget is not None:
            self.event(fmt.EventKind.END, self.last_step, budget=budget)
        else:
            self.flush()
        self.closed = True

    # -- segments ----------------------------------------------------------------------------------
    def _submit(self, final: bool) -> None:
        """Queues a write of the current segment as it is now; `final`: it is full, the next one starts."""
        with self._mutex:
            self.since_flush, self.flushed_at = 0, time.monotonic()
            segment, rows, count, events = self.segment, self.rows, len(self.rows), list(self.events)
            if final:
                self.segment += 1
                self.rows, self.events = [], []
        if self.failed:
            return

        def write() -> None:
            try:
                with self._lock:
                    self._write_segment(segment, rows, count, events, final)
            except Exception as exc:  # noqa: BLE001
                self._give_up(f"writing the run log failed ({type(exc).__name__}: {exc})")

        if self.background is None:
            write()
        else:
            self.background(write)

    def _write_segment(self, segment: int, rows: list[tuple], count: int, events: list[dict], final: bool) -> None:
        """The writer thread: converts the rows it has not seen yet, rewrites the segment whole; a full one is
        kept (thinned, in memory) until FULL_SEGMENTS newer ones exist, then rewritten thinned."""
        stored, lines = self._stored, self._lines
        for raw in rows[len(stored) : count]:
            stored.append(fmt.row(*raw))
            lines.append(fmt.row_line(stored[-1]))
        header = {**self.header, "segment": segment, "level": 0}
        if self.wanted and self._held:
            for path, data in self._held.values():
                _replace(path, data)
            self._held.clear()
        self._put(self._path(segment), fmt.encode_lines(header, lines, events))
        if not final:
            return
        self._thinning.append((segment, fmt.thin(stored, events), events))
        self._stored, self._lines = [], []
        if len(self._thinning) > fmt.FULL_SEGMENTS:
            old, thinned, old_events = self._thinning.popleft()
            header = {**self.header, "segment": old, "level": 1, "bucket": fmt.BUCKET_ROWS}
            self._put(self._path(old), fmt.encode_segment(header, thinned, old_events))

    def _put(self, path: Location, data: bytes) -> None:
        if self.wanted:
            _replace(path, data)
        else:
            self._held[str(path)] = (path, data)

    def _path(self, segment: int) -> Location:
        return self.directory / f"seg-{segment:06d}.jsonl"

    def _give_up(self, why: str) -> None:
        if not self.failed:
            self.failed = True
            log.warning("forensics: the run log stops: %s (training and dumps are not affected)", why, exc_info=True)


def _replace(path: Location, data: bytes) -> None:
    """Writes `path` whole: locally a temporary file renamed over it, in object storage one object."""
    if isinstance(path, RemotePath):
        with open_write(path) as f:
            f.write(data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def _close_at_exit(ref: "weakref.ref[RunLog]") -> None:
    live = ref()
    if live is not None:
        live.close()
