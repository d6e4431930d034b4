"""A dump in object storage fetched while the replay gets ready: `start_fetching(url, rank)` opens the dump and starts
the fetch of every file it lists (Dump.prefetch: verified local copies, forensics.format.spool) on a thread of its
own, before the command imports torch and the model's code; the replay's own `open_dump` of the same location then
takes that Dump (`claim`) instead of opening it again. A download followed by a local replay cannot overlap its
transfer with those seconds; a replay from the URL does.

The handover is one-shot and exact: the same location, rank, archive limits and shard directories, or nothing is
taken. What the open raised, `claim` raises (the same call: a store that did not answer is not asked twice); a file
that could not be fetched is said by the replay's own read of it, worded as always.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from forensics.format.limits import ArchiveLimits
    from forensics.format.location import Location
    from forensics.format.reader import Dump

_lock = threading.Lock()
_started: dict[tuple, tuple[threading.Thread, list[Any]]] = {}
"""Key of an open_dump call -> the thread opening it and the Dump it opened (empty when it failed)."""


def _key(path: Any, rank: int | None, limits: ArchiveLimits | None, shard_dirs: Sequence[Any]) -> tuple:
    return (str(path), rank, repr(limits), tuple(map(str, shard_dirs)))


def start_fetching(
    path: str | os.PathLike[str] | Location,
    rank: int | None = None,
    limits: ArchiveLimits | None = None,
    shard_dirs: Sequence[str | os.PathLike[str] | Location] = (),
) -> None:
    """Opens the dump at `path` as `open_dump(path, rank, limits, shard_dirs)` would and starts fetching its files,
    on a daemon thread; returns at once. For a dump in object storage (on disk there is nothing to fetch)."""
    from forensics.core.errors import ForensicsError
    from forensics.format.reader import open_unclaimed  # imported here: never by two threads at once

    key = _key(path, rank, limits, shard_dirs)
    opened: list[Any] = []

    def run() -> None:
        try:
            dump = open_unclaimed(path, rank, limits, shard_dirs)
        except (ForensicsError, OSError, ValueError) as exc:  # the replay's own open_dump raises it (claim)
            opened.append(exc)
            return
        opened.append(dump)
        try:
            dump.prefetch()
        except (ForensicsError, OSError):  # a file the replay then reads says it again, worded as always
            pass

    thread = threading.Thread(target=run, name="forensics-prefetch", daemon=True)
    with _lock:
        if key in _started:
            return
        _started[key] = (thread, opened)
    thread.start()


def claim(
    path: str | os.PathLike[str] | Location,
    rank: int | None,
    limits: ArchiveLimits | None,
    shard_dirs: Sequence[str | os.PathLike[str] | Location],
) -> Dump | None:
    """The Dump `start_fetching` opened for exactly these arguments (waiting for its open to finish), once; None when
    none was started.

    Raises:
        what that open raised (the same call: a store that did not answer is not asked again).
    """
    with _lock:
        started = _started.pop(_key(path, rank, limits, shard_dirs), None)
    if started is None:
        return None
    thread, opened = started
    thread.join()
    if not opened:  # the thread died some other way: open here
        return None
    if isinstance(opened[0], BaseException):
        raise opened[0]
    return cast("Dump", opened[0])


__all__ = ["claim", "start_fetching"]
