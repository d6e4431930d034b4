"""Safe unpacking of a `.tar.zst` dump archive into a temporary directory (what every reader does with one).

Members are extracted with tarfile's "data" filter (no absolute paths, no '..', nothing outside the
destination, no special files, safe permissions), and only regular files and directories are
accepted: a dump holds nothing else.
"""

from __future__ import annotations

import stat
import tarfile
import tempfile
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import zstandard

from forensics.core.errors import DumpCorruptError, NotADumpError
from forensics.format import spec
from forensics.format.limits import GiB, ArchiveLimits
from forensics.format.location import Location, file_size, open_read


def _allowed_bytes(limits: ArchiveLimits, archive_bytes: int) -> int:
    return min(limits.max_bytes, max(GiB, int(limits.max_ratio * archive_bytes)))


class _CappedStream:
    """The decompressed tar stream, refused once it passes `cap` bytes: bounds what tarfile reads even for
    headers it buffers whole (a pax header that claims gigabytes)."""

    def __init__(self, stream: Any, cap: int):
        self.stream, self.cap, self.seen = stream, cap, 0

    def read(self, size: int = -1) -> bytes:
        data: bytes = self.stream.read(size if size >= 0 else self.cap + 1 - self.seen)
        self.seen += len(data)
        if self.seen > self.cap:
            raise DumpCorruptError(
                f"the archive unpacks to more than {self.cap} bytes (headers included); "
                "refusing to unpack (raise --max-unpacked-gb / --max-unpack-ratio if it is genuine)"
            )
        return data


def _dump_members(tar: tarfile.TarFile, limits: ArchiveLimits, archive_bytes: int) -> Iterator[tarfile.TarInfo]:
    members = total = 0
    allowed = _allowed_bytes(limits, archive_bytes)
    for member in tar:
        name = member.name[:200]
        members += 1
        if members > limits.max_members:
            raise DumpCorruptError(
                f"the archive has more than {limits.max_members} members; refusing to unpack "
                "(raise the limit with --max-members if it is genuine)"
            )
        if len(member.name) > limits.max_path_chars or member.name.count("/") >= limits.max_depth:
            raise DumpCorruptError(
                f"archive member {name!r} has a path longer or deeper than a dump's "
                f"({limits.max_path_chars} characters, {limits.max_depth} levels); refusing to unpack"
            )
        if member.name.startswith("/"):  # the data filter would strip the "/" and extract it inside: refuse
            raise DumpCorruptError(f"archive member {name!r} escapes the archive (absolute path); refusing to unpack")
        if not (member.isfile() or member.isdir()):
            raise DumpCorruptError(f"archive member {name!r} is a link or device; refusing to unpack")
        if member.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
            raise DumpCorruptError(
                f"archive member {name!r} has mode {member.mode:o} (setuid, setgid or sticky), "
                "which no file of a dump has; refusing to unpack"
            )
        total += member.size
        if total > allowed:
            raise DumpCorruptError(
                f"the archive unpacks to more than {allowed} bytes ({archive_bytes} packed); refusing to unpack "
                "(raise --max-unpacked-gb / --max-unpack-ratio if it is genuine)"
            )
        yield member


def unpack_archive(
    path: Location, limits: ArchiveLimits | None = None
) -> tuple[Path, tempfile.TemporaryDirectory[str]]:
    """Unpacks into a temporary directory, within `limits` (checked on each member's header, before its
    bytes are written); returns the dump directory and the holder keeping it alive.

    Raises:
        DumpCorruptError: a member escapes, is a link or device, or a limit is exceeded (nothing is left behind).
    """
    if not hasattr(tarfile, "data_filter"):
        raise DumpCorruptError(
            f"reading {path} needs tarfile's data filter (Python >= 3.10.12 / 3.11.4 / 3.12); "
            "upgrade Python, or unpack the archive by hand and pass the directory"
        )
    holder = tempfile.TemporaryDirectory(prefix="forensics-")
    root = Path(holder.name)
    try:
        with open_read(path) as raw:
            with zstandard.ZstdDecompressor().stream_reader(raw) as stream:
                limits = limits or ArchiveLimits()
                packed = file_size(path)
                capped = _CappedStream(stream, _allowed_bytes(limits, packed) + limits.max_members * 1024 + GiB // 64)
                with tarfile.open(fileobj=capped, mode="r|") as tar:  # type: ignore[call-overload]  # typeshed wants write/seek of a stream that is only read
                    for member in _dump_members(tar, limits, packed):
                        tar.extract(member, root, set_attrs=False, filter="data")
    except tarfile.FilterError as exc:
        holder.cleanup()
        raise DumpCorruptError(
            f"archive member {exc.tarinfo.name!r} escapes the archive ({exc}); refusing to unpack"
        ) from exc
    except (tarfile.TarError, zstandard.ZstdError, EOFError, OSError, MemoryError, RecursionError) as exc:
        holder.cleanup()
        size = file_size(path) if path.exists() else 0
        if isinstance(exc, EOFError) or "empty file" in str(exc) or "unexpected end" in str(exc):
            reason = f"it ends before the archive does: the file is truncated ({size} bytes), or not a dump archive"
        else:
            reason = f"{type(exc).__name__}: {str(exc)[:200]}"
        raise DumpCorruptError(f"{path} is not a readable {spec.ARCHIVE_SUFFIX} dump archive: {reason}") from exc
    except DumpCorruptError:
        holder.cleanup()
        raise
    tops = [p for p in root.iterdir()]
    if len(tops) != 1 or not tops[0].is_dir():
        holder.cleanup()
        raise NotADumpError(f"{path} does not hold one dump directory")
    return tops[0], holder
