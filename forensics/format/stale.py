"""Unfinished dumps left behind: `.tmp-*` directories of writers that were killed mid-write (SIGKILL,
OOM killer, a node lost). They are never read as dumps; this finds and removes them safely.

A writer names its temporary directory `.tmp-<rank dir>-<host>-<pid>-<random>`. One is stale when its
writer is known to be gone (same host, and no process has that pid) or, for directories written on
another host (a shared file system) or by an older writer, when it has not changed for STALE_AFTER_S.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from pathlib import Path

STALE_AFTER_S = 24 * 3600  # a dump is written in seconds to minutes; a day-old unfinished one is dead
PREFIX = ".tmp-"


def temporary_name(final_name: str) -> str:
    """The temporary directory name a writer of `final_name` (e.g. rank-00003) uses."""
    host = socket.gethostname().replace("-", "_")[:64] or "host"
    return f"{PREFIX}{final_name}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _writer_gone(name: str) -> bool:
    parts = name.rsplit("-", 3)  # .tmp-rank-00003 | host | pid | random
    if len(parts) != 4 or not parts[2].isdigit():
        return False
    host = socket.gethostname().replace("-", "_")[:64] or "host"
    pid = int(parts[2])
    if parts[1] != host or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, OSError):
        return False
    return False


def stale_temporaries(root: str | os.PathLike[str], now: float | None = None) -> list[Path]:
    """The stale `.tmp-*` directories under `root` (a dump, run or step directory: `.../step-<N>/.tmp-*`)."""
    now = time.time() if now is None else now
    found = []
    for path in Path(root).rglob(f"{PREFIX}*"):
        try:
            if not path.parent.name.startswith("step-") or path.is_symlink() or not path.is_dir():
                continue
            if _writer_gone(path.name) or now - path.stat().st_mtime > STALE_AFTER_S:
                found.append(path)
        except OSError:
            continue
    return sorted(found)


def remove_stale_temporaries(root: str | os.PathLike[str]) -> list[Path]:
    """Removes the stale `.tmp-*` directories under `root`; returns those removed. Never raises."""
    removed: list[Path] = []
    try:
        candidates = stale_temporaries(root)
    except OSError:
        return removed
    for path in candidates:
        try:
            shutil.rmtree(path)
            removed.append(path)
        except OSError:
            continue
    return removed
