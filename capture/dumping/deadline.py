"""A dump to object storage under a stall deadline: training (and a SIGTERM held for the dump) never waits on a store
that stopped taking data longer than DumpConfig.write_stall_timeout.

The write runs on a worker thread and tells a `WriteWatch` of every piece it sends (forensics.format.writer cuts a
large file into 8 MiB pieces); the caller waits while pieces keep coming. When none came for the stall deadline, the
write is abandoned: the caller gets a CaptureError at once (the Guard then applies the step's policy), and the
worker, as soon as its blocked request returns (each is bounded by DumpConfig.storage_timeout and storage_retries),
stops at its next piece — no manifest is ever written — and deletes what it wrote. A local dump_dir is written on
the caller's thread, as before.
"""

from __future__ import annotations

import threading
import time
from typing import cast

from forensics.core.errors import CaptureError
from forensics.format.location import Location, RemotePath
from forensics.format.writer import DumpContent, write_dump


class WriteAbandoned(Exception):
    """Raised inside an abandoned write, at its next piece: the writer then removes what it wrote."""


class WriteWatch:
    """When a write last sent a piece; `abandon()` makes its next piece raise WriteAbandoned."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self.abandoned: str | None = None

    def progress(self) -> None:
        if self.abandoned is not None:
            raise WriteAbandoned(self.abandoned)
        self._last = time.monotonic()

    def idle_s(self) -> float:
        return time.monotonic() - self._last

    def abandon(self, why: str) -> None:
        self.abandoned = why


def store(content: DumpContent, root: Location, stall_s: float) -> Location:
    """`write_dump(content, root)`, given up when a remote write sends nothing for `stall_s` seconds.

    Raises:
        CaptureError: the write failed, or stalled (says so; the worker removes what it wrote when it can).
    """
    if not isinstance(root, RemotePath):
        return write_dump(content, root)
    watch = WriteWatch()
    outcome: dict[str, object] = {}

    def write() -> None:
        try:
            outcome["path"] = write_dump(content, root, watch)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = exc

    worker = threading.Thread(target=write, name="forensics-dump-store", daemon=True)
    worker.start()
    while True:
        worker.join(min(1.0, stall_s / 4))
        if not worker.is_alive():
            break
        if watch.idle_s() > stall_s:
            why = (
                f"no dump written under {root}: the store took no data for {stall_s:g} s "
                "(DumpConfig.write_stall_timeout); the write is abandoned and what it sent is deleted once the store "
                "answers again"
            )
            watch.abandon(why)
            raise CaptureError(why)
    error = outcome.get("error")
    if isinstance(error, BaseException):
        raise error  # CaptureError, as write_dump raises it
    return cast(Location, outcome["path"])
