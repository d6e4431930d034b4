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
_started: dict[tuple, tuple[threading.Thread, list[Any], list[bool]]] = {}
"""Key of an open_dump call -> the thread opening it, what the open gave (a Dump, or the exception it raised) and
whether it was released (`release`: the Dump is closed once opened)."""


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
    released = [False]

    def run() -> None:
        try:
            dump = open_and_fetch()
        except (ForensicsError, OSError, ValueError) as exc:  # the replay's own open_dump raises it (claim)
            opened.append(exc)
            return
        except Exception:  # noqa: BLE001 - anything else: no traceback from this thread; claim gives None and the
            return  # replay's own open_dump meets it again and says it as always
        with _lock:
            opened.append(dump)
            close = released[0]
        if close:  # nobody will claim it: its fetch stops
            dump.close()

    thread = threading.Thread(target=run, name="forensics-prefetch", daemon=True)
    with _lock:
        if key in _started:
            return
        _started[key] = (thread, opened, released)
    thread.start()


def release() -> None:
    """What `start` opened and nobody claimed (the command ended first: an error, Ctrl-C during the imports) is
    closed, now or as soon as its open ends, so that no fetch goes on after the command (the interpreter's exit would
    wait for the fetch pool to finish every file)."""
    with _lock:
        left = list(_started.values())
        _started.clear()
        for _, _, released in left:
            released[0] = True
        dumps = [opened[0] for _, opened, _ in left if opened and not isinstance(opened[0], BaseException)]
    for dump in dumps:
        dump.close()


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
    thread, opened, released = started
    try:
        thread.join()
    except BaseException:  # Ctrl-C while waiting: nobody will take what the open gives
        with _lock:
            released[0] = True
            dump = opened[0] if opened and not isinstance(opened[0], BaseException) else None
        if dump is not None:
            dump.close()
        raise
    if not opened:
        return None
    if isinstance(opened[0], BaseException):
        raise opened[0]
    return opened[0]


__all__ = ["claim", "release", "start"]
