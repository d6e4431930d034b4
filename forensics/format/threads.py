"""Work handed to a thread pool, or done on the calling thread when the pool refuses it because the interpreter
is shutting down (concurrent.futures' exit hook runs before atexit's: a dump finished at exit must still be written,
capture/dumping/writer_thread.py)."""

from __future__ import annotations

from typing import Any, Callable


class Done:
    """A finished job with a Future's `result()`."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


def submit(pool: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """`pool.submit(fn, *args)`; after interpreter shutdown began ("cannot schedule new futures after interpreter
    shutdown"), `fn(*args)` run here, as a Done."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        return Done(fn(*args))
