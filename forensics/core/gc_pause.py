"""Python's cyclic garbage collector paused while a replay starts: libraries import and the dump's step loads.

Importing torch, torch._dynamo (every torch optimizer imports it) and transformers creates millions of objects that
all live on; the collector's full passes walk every one of them again and again while they are created, and find
almost nothing to free (0.4-0.5 s of a demo replay's start on the 2-core CPU dev machine, BENCHMARKS.md). Reference
counting still frees everything at once while paused; only objects in reference cycles wait until the collector
runs again. The collector's state is restored afterwards, so a caller that had it off keeps it off.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (a function decorator too: `@gc_paused()`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
