"""One background thread that writes non-fatal dumps while training goes on, and finishes them when the job ends.

A dump still being written when the job ends is not lost: at interpreter exit (an atexit hook) and on SIGTERM (a
handler chained to the one installed before: it waits, then hands the signal on — the process still ends as it
would have) the writes are waited for, at most EXIT_WAIT_S seconds, with a message saying so; further SIGTERMs and
Ctrl-Cs during that wait are held and handed on after it (capture/dumping/signals.py). At exit,
concurrent.futures has already refused new work (its own exit hook runs before atexit's), so the writer then
writes on its own thread (forensics/format/threads.py).
"""

from __future__ import annotations

import atexit
import logging
import queue
import signal
import threading
from typing import Any, Callable

from forensics.capture.dumping.signals import deferred_termination, hand_on
from forensics.core.errors import CaptureError
from forensics.format.location import Location
from forensics.format.writer import DumpContent, dump_path, write_dump

log = logging.getLogger(__name__)

EXIT_WAIT_S = 120.0
"""How long the end of the job (interpreter exit, SIGTERM) waits for dumps still being written: a multi-GB state
takes seconds to write; a scheduler's kill (torchrun: SIGKILL 30 s after SIGTERM) may come first."""


_on_writer = threading.local()
"""`yes` on a writer thread."""


class BackgroundWriter:
    """Writes queued dumps in order on one daemon thread; `after_queued` runs a function after the writes queued
    before it (deleting a replaced dump)."""

    def __init__(self, write: Callable[[DumpContent, Location], Location] = write_dump):
        self._write = write  # the Dumper's: object storage under its stall deadline
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._hooked = False
        self._sigterm_hooked = False
        self._pending = 0
        self._failed = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Dumps queued or being written."""
        with self._lock:
            return self._pending

    def submit(
        self, content: DumpContent, root: Location, on_done: Callable[[Location], None], on_error: Callable[[str], None]
    ) -> Location:
        """Queues `content`; returns where the dump will appear once written."""
        self._start()
        with self._lock:
            self._pending += 1
        self._queue.put(("write", (content, root, on_done, on_error)))
        m = content.manifest
        return dump_path(root, m["run_id"], m["step"], m["rank"])

    def after_queued(self, fn: Callable[[], None]) -> None:
        """Runs `fn` once every write queued so far is done (now, when none is)."""
        if self._thread is None:
            fn()
        else:
            self._queue.put(("call", fn))

    def call(self, fn: Callable[[], None]) -> None:
        """Runs `fn` on the writer thread, after the writes queued before it (the run log's segments); called on
        the writer thread itself (a callback of a write), runs it there and then."""
        if getattr(_on_writer, "yes", False):
            fn()
            return
        self._start()
        self._queue.put(("call", fn))

    def _start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="forensics-dump-writer", daemon=True)
        self._thread.start()
        if not self._hooked:
            self._hooked = True
            atexit.register(self._at_exit)

    def hook_sigterm(self) -> None:
        """Finish the dumps on SIGTERM too (once; call it outside agreement.deferred_termination, which puts back
        the handler it found when it ends)."""
        if self._thread is not None and not self._sigterm_hooked:
            self._sigterm_hooked = True
            _chain_sigterm(self)

    def _run(self) -> None:
        _on_writer.yes = True
        while True:
            item = self._queue.get()
            try:
                if item is None:  # join(): nothing more to write, let the thread end before interpreter exit
                    return
                what, payload = item
                if what == "call":
                    payload()
                    continue
                content, root, on_done, on_error = payload
                try:
                    path = self._write(content, root)
                except CaptureError as exc:
                    self._count_failure()
                    on_error(str(exc))
                except Exception as exc:  # noqa: BLE001 - never let the thread die silently
                    self._count_failure()
                    on_error(f"no dump written: {type(exc).__name__}: {exc}")
                else:
                    on_done(path)
                finally:
                    with self._lock:
                        self._pending -= 1
            except Exception:  # a callback that raises must not end the thread
                log.exception("forensics: the background dump writer hit an error")
            finally:
                self._queue.task_done()

    def _count_failure(self) -> None:
        with self._lock:
            self._failed += 1

    def join(self, timeout: float | None = None) -> bool:
        """Blocks until every queued dump is written (or `timeout` seconds pass). Returns True when none is left."""
        if self._thread is None:
            return True
        thread, self._thread = self._thread, None
        self._queue.put(None)  # after every queued dump: the thread writes them, then ends
        thread.join(timeout)
        if thread.is_alive():
            log.error(
                "forensics: background dump writes did not finish within %s s; %d dump(s) are lost (an "
                "unfinished one is removed at the next run's first dump)",
                timeout,
                self.pending,
            )
            return False
        return True

    def finish(self, why: str) -> None:
        """The job ends (`why`): waits for the dumps still being written, at most EXIT_WAIT_S, saying so."""
        pending = self.pending
        if self._thread is None or not pending:
            return
        with self._lock:
            failed_before = self._failed
        log.warning("forensics: %s: waiting up to %.0f s for %d dump(s) still being written", why, EXIT_WAIT_S, pending)
        with deferred_termination():  # a SIGTERM or Ctrl-C now ends the job once the dumps are written (and said)
            if not self.join(EXIT_WAIT_S):
                return
            with self._lock:
                failed = self._failed - failed_before
            if failed:  # each said why already ("no dump written: ...")
                log.error("forensics: %d of the %d dump(s) could not be written (see above)", failed, pending)
            else:
                log.warning("forensics: the dump(s) are written")

    def _at_exit(self) -> None:
        self.finish("the job is exiting")


def _chain_sigterm(writer: BackgroundWriter) -> None:
    """Installs a SIGTERM handler that finishes `writer`'s dumps, then hands the signal to the handler that was
    installed before (the default one: the process ends by SIGTERM, as it would have). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return  # the job ignores SIGTERM: nothing ends, nothing to finish

        def on_sigterm(signum: int, frame: Any) -> None:
            with deferred_termination(deliver=False) as later:  # a second SIGTERM, a Ctrl-C: after the dumps
                writer.finish("SIGTERM received")
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
                signal.raise_signal(signal.SIGTERM)
            hand_on(later, skip=signal.SIGTERM)  # a Ctrl-C that came too, where the previous handler went on

        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):  # not allowed here (embedded interpreter)
        log.debug("forensics: no SIGTERM handler installed for the dump writer", exc_info=True)
