"""One background thread that writes non-fatal dumps while training goes on; joined at exit."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from pathlib import Path
from typing import Callable

from forensics.errors import CaptureError
from forensics.format.writer import DumpContent, dump_path, write_dump

log = logging.getLogger(__name__)


class BackgroundWriter:
    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._at_exit = False

    def submit(self, content: DumpContent, root: str, on_done: Callable[[Path], None],
               on_error: Callable[[str], None]) -> Path:
        """Queues `content`; returns where the dump will appear once written."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="forensics-dump-writer", daemon=True)
            self._thread.start()
            if not self._at_exit:
                atexit.register(self.join)
                self._at_exit = True
        self._queue.put((content, root, on_done, on_error))
        m = content.manifest
        return dump_path(Path(root), m["run_id"], m["step"], m["rank"])

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # join(): nothing more to write, let the thread end before interpreter exit
                self._queue.task_done()
                return
            content, root, on_done, on_error = item
            try:
                on_done(write_dump(content, root))
            except CaptureError as exc:
                on_error(str(exc))
            except Exception as exc:  # noqa: BLE001 - never let the thread die silently
                on_error(f"no dump written: {type(exc).__name__}: {exc}")
            finally:
                self._queue.task_done()

    def join(self, timeout: float | None = None) -> None:
        """Blocks until every queued dump is written (or `timeout` seconds pass)."""
        if self._thread is None:
            return
        thread, self._thread = self._thread, None
        self._queue.put(None)  # after every queued dump: the thread writes them, then ends
        thread.join(timeout)
        if thread.is_alive():
            log.error("forensics: background dump writes did not finish within %s s", timeout)
