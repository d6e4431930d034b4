"""Atomic file writes, the one way forensics writes a file a reader may see half-written.

A file is written to a temporary name in the same directory, flushed, fsynced, given the usual
permissions (temporary files are created 0600; reports and archives are shared as job artifacts)
and renamed over the target, so a reader sees the old file or the whole new one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], binary: bool = False) -> Iterator[IO[Any]]:
    """Opens a temporary file next to `path` for writing; on a clean exit it replaces `path`.

    Args:
        path: the file to (re)write; its directory is created when missing.
        binary: bytes instead of UTF-8 text.
    Yields:
        The open file. On an exception nothing is left behind and `path` is unchanged.
    Example:
        >>> with atomic_file(tmp_dir / "report.json") as f:  # doctest: +SKIP
        ...     f.write("{}")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Writes `text` (UTF-8) to `path` atomically; returns the path."""
    with atomic_file(path) as handle:
        handle.write(text)
    return Path(path)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Makes a rename inside `path` durable (best effort: some file systems refuse to fsync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def our_code_directories() -> tuple[str, ...]:
    """The directories forensics' own code is loaded from, each ending in a separator: the package, and the folders
    its links forensics/capture and forensics/replay lead to in a source checkout (a traceback names either)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # forensics/core/ -> forensics/
    found = [package]
    for side in ("capture", "replay"):
        real = os.path.realpath(os.path.join(package, side))
        if real not in found and not real.startswith(package + os.sep):
            found.append(real)
    return tuple(d + os.sep for d in found)
