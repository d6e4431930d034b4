"""A dump in object storage fetched while the replay gets ready: `forensics.format.reader.start_fetching(url, rank)`
opens the dump and starts the fetch of every file it lists (Dump.prefetch: verified local copies,
forensics.format.spool) on a thread of its own, before the command imports torch and the model's code; the replay's
own `open_dump` of the same location then takes that Dump (`claim`) instead of opening it again. A download followed
by a local replay cannot overlap its transfer with those seconds; a replay from the URL does.

This module is the handover only (it imports nothing of the reader). It is one-shot and exact: the same location,
rank, archive limits and shard directories, or nothing is taken. What the open raised, `claim` raises (the same call:
a store that did not answer is not asked twice); a file that could not be fetched is said by the replay's own read of
it, worded as always.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

_lock = threading.Lock()
_started: dict[tuple, tuple[threading.Thread, list[Any]]] = {}
"""Key of an open_dump call -> the thread opening it and what the open gave (a Dump, or the exception it raised)."""


def _key(path: Any, rank: int | None, limits: Any, shard_dirs: Sequence[Any]) -> tuple:
    return (str(path), rank, repr(limits), tuple(map(str, shard_dirs)))


def start(
    path: Any, rank: int | None, limits: Any, shard_dirs: Sequence[Any], open_and_fetch: Callable[[], Any]
) -> None:
    """Runs `open_and_fetch` (open_dump's work for these arguments, then the fetch) on a daemon thread; returns at
    once. Its Dump, or the ForensicsError / OSError / ValueError it raised, goes to `claim` with the same arguments."""
    from forensics.core.errors import ForensicsError

    key = _key(path, rank, limits, shard_dirs)
    opened: list[Any] = []

    def run() -> None:
        try:
            opened.append(open_and_fetch())
        except (ForensicsError, OSError, ValueError) as exc:  # the replay's own open_dump raises it (claim)
            opened.append(exc)

    thread = threading.Thread(target=run, name="forensics-prefetch", daemon=True)
    with _lock:
        if key in _started:
            return
        _started[key] = (thread, opened)
    thread.start()


def claim(path: Any, rank: int | None, limits: Any, shard_dirs: Sequence[Any]) -> Any:
    """What `start` opened for exactly these arguments (waiting for it to finish), once; None when nothing was started
    (or its thread died some other way: the caller opens the dump itself).

    Raises:
        what that open raised.
    """
    with _lock:
        started = _started.pop(_key(path, rank, limits, shard_dirs), None)
    if started is None:
        return None
    thread, opened = started
    thread.join()
    if not opened:
        return None
    if isinstance(opened[0], BaseException):
        raise opened[0]
    return opened[0]


__all__ = ["claim", "start"]
