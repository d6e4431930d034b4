"""Termination signals held back while a dump is being written, then handed on: the job still ends as it would have.

When one rank dies, torchrun sends SIGTERM to the others (and SIGKILL 30 s later); a job scheduler preempting a run
does the same, often twice; a user presses Ctrl-C (SIGINT), sometimes after a SIGTERM. Any of them arriving while a
dump is written — the synchronous write of a crash, or the exit flush of a spike dump still in the background writer
(capture/dumping/writer_thread.py) — would end the job mid-write and lose the dump (a `.tmp-*` directory, never
trusted). So while a dump is in flight every SIGTERM and SIGINT, in any number and order, is only noted; once it is
written (or the flush gave up at its limit) the handlers the job had are put back and each signal that came is raised
again, first one first: the default SIGTERM ends the process by SIGTERM, Ctrl-C raises KeyboardInterrupt. Only
SIGKILL can still interrupt a write. Only the main thread can install handlers; elsewhere nothing is held.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Any, Iterator

log = logging.getLogger(__name__)

HELD = (signal.SIGTERM, signal.SIGINT)
"""The signals that end a job and that a handler can hold back (SIGKILL cannot be caught)."""

_holding: list[int] | None = None
"""The signals noted by the hold in force (None: none is), in the order they came."""


@contextlib.contextmanager
def deferred_termination(deliver: bool = True) -> Iterator[list[int]]:
    """Holds SIGTERM and SIGINT back while a dump is written; yields the list of those that came, in order.

    Args:
        deliver: on leaving, raise each signal that came again (once per kind, first one first) under the handler
            the job had. False: the caller hands them on itself (the SIGTERM handler of the exit flush, which must
            call the handler installed before its own).
    A hold inside a hold holds nothing more: the outer one hands the signals on.
    """
    global _holding
    if _holding is not None or threading.current_thread() is not threading.main_thread():
        yield [] if _holding is None else _holding
        return
    received: list[int] = []

    def note(signum: int, frame: Any) -> None:
        received.append(signum)
        if received.count(signum) == 1:
            log.warning(
                "forensics: %s received while writing the dump; finishing the dump first", signal.Signals(signum).name
            )

    previous: dict[int, Any] = {}
    try:
        for signum in HELD:
            handler = signal.getsignal(signum)
            if handler is signal.SIG_IGN or handler is None:  # ignored, or not set from Python: left as it is
                continue
            previous[signum] = signal.signal(signum, note)
    except (ValueError, OSError):  # not allowed here (an embedded interpreter)
        _restore(previous)
        yield received
        return
    _holding = received
    try:
        yield received
    finally:
        _holding = None
        _restore(previous)
        if deliver:
            hand_on(received)


def hand_on(received: list[int], skip: int | None = None) -> None:
    """Raises each signal in `received` again (once per kind, in the order they first came) under the handlers now
    installed, except `skip` (a signal the caller handed on already)."""
    for signum in dict.fromkeys(received):
        if signum != skip:
            signal.raise_signal(signum)


def _restore(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
