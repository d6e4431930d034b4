"""`.tar.zst` packing of a dump for job artifacts, and safe unpacking (no absolute paths, no '..', no links)."""

from __future__ import annotations

import os
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

import zstandard

from forensics.errors import DumpCorruptError, NotADumpError
from forensics.format import spec


def pack_dump(path: str | Path, output: str | Path | None = None) -> Path:
    """Packs a dump directory (rank or step) into one `.tar.zst`; returns the archive path.

    Example:
        >>> pack_dump("crash_dumps/run/step-000000042")  # doctest: +SKIP
        PosixPath('crash_dumps/run/step-000000042.tar.zst')
    """
    from forensics.format.reader import open_step

    source = Path(path)
    if not source.is_dir():
        raise NotADumpError(f"{source} is not a dump directory; pack takes a rank or step directory")
    open_step(source)  # refuses anything that is not a complete dump
    target = Path(output) if output else source.with_name(source.name + spec.ARCHIVE_SUFFIX)
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "wb") as raw:
        with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as compressed:
            with tarfile.open(fileobj=compressed, mode="w|") as tar:
                for file in sorted(source.rglob("*")):
                    if file.name.startswith(".tmp-") or any(p.startswith(".tmp-") for p in file.relative_to(source).parts):
                        continue
                    tar.add(file, arcname=str(PurePosixPath(source.name) / file.relative_to(source).as_posix()),
                            recursive=False)
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, target)
    return target


def _safe_members(tar: tarfile.TarFile):
    for member in tar:
        name = PurePosixPath(member.name)
        if name.is_absolute() or ".." in name.parts:
            raise DumpCorruptError(f"archive member {member.name!r} escapes the archive; refusing to unpack")
        if not (member.isfile() or member.isdir()):
            raise DumpCorruptError(f"archive member {member.name!r} is a link or device; refusing to unpack")
        yield member


def unpack_archive(path: Path) -> tuple[Path, tempfile.TemporaryDirectory]:
    """Unpacks into a temporary directory; returns the dump directory and the holder keeping it alive."""
    holder = tempfile.TemporaryDirectory(prefix="forensics-")
    root = Path(holder.name)
    try:
        with open(path, "rb") as raw:
            with zstandard.ZstdDecompressor().stream_reader(raw) as stream:
                with tarfile.open(fileobj=stream, mode="r|") as tar:
                    for member in _safe_members(tar):
                        tar.extract(member, root, set_attrs=False)
    except (tarfile.TarError, zstandard.ZstdError, EOFError, OSError) as exc:
        holder.cleanup()
        raise DumpCorruptError(f"{path} is not a readable {spec.ARCHIVE_SUFFIX} dump archive ({exc}); "
                               "it may be truncated") from exc
    except DumpCorruptError:
        holder.cleanup()
        raise
    tops = [p for p in root.iterdir()]
    if len(tops) != 1 or not tops[0].is_dir():
        holder.cleanup()
        raise NotADumpError(f"{path} does not hold one dump directory")
    return tops[0], holder
