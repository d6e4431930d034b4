"""Allocations left uninitialised under deterministic algorithms, for memory that is overwritten whole at once.

`torch.use_deterministic_algorithms(True)` (replay runs under it: replay/load/environment.py) also makes every
`torch.empty` fill its memory with NaN or the integer maximum (`torch.utils.deterministic.fill_uninitialized_memory`,
torch >= 2.1): one more write over every byte. For a dump's tensors read into fresh buffers that is a second pass over
the whole state, and for a model built with meta parameters a write of every weight that is moved to the meta device
at once (0.96 s of a 0.7B Llama's load on the H200 machine, BENCHMARKS.md "Scale table"). Inside `unfilled()` the
fill is off; the setting is process-wide, so nested and concurrent users (the optimizer read-ahead thread) are
counted and the caller's setting comes back when the last one leaves.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.utils.deterministic

_settings: Any = torch.utils.deterministic  # its flag is a property of a module subclass the stubs do not show
_lock = threading.Lock()
_users = 0
_saved = True


@contextlib.contextmanager
def unfilled() -> Iterator[None]:
    """No fill of uninitialised memory inside the block (for allocations the block overwrites whole)."""
    global _users, _saved
    with _lock:
        if _users == 0:
            _saved = _settings.fill_uninitialized_memory
            _settings.fill_uninitialized_memory = False
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                _settings.fill_uninitialized_memory = _saved
