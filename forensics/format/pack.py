"""`forensics pack`: a dump directory (rank or step) as one `.tar.zst` for job artifacts."""

from __future__ import annotations

import tarfile
from pathlib import Path, PurePosixPath

import zstandard

from forensics.core.errors import DumpCorruptError, NotADumpError
from forensics.format import spec
from forensics.format.reader import Dump, is_rank_dump
from forensics.format.verify import verify_dump
from forensics.core.fsio import atomic_file


def pack_dump(path: str | Path, output: str | Path | None = None, *, rank_part: bool = False) -> Path:
    """Packs a dump directory (rank or step) into one `.tar.zst`; returns the archive path.

    One rank of a sharded dump is refused (alone it replays nothing) unless `rank_part` (a rank uploading its
    own part: the tracker then holds every rank's archive).

    Example:
        >>> pack_dump("crash_dumps/run/step-000000042")  # doctest: +SKIP
        PosixPath('crash_dumps/run/step-000000042.tar.zst')
    """
    source = Path(path)
    if not source.is_dir() or source.is_symlink():
        raise NotADumpError(f"{source} is not a dump directory; pack takes a rank or step directory")
    if not rank_part and is_rank_dump(source) and Dump(source).sharded:
        raise NotADumpError(
            f"{source} is one rank's part of a sharded dump: alone it cannot be replayed. Pack its "
            f"step directory ({source.parent}) instead"
        )
    result = verify_dump(source, whole_state=not rank_part)  # refuses what a reader would: links, changed files
    if not result.ok:
        raise DumpCorruptError(
            f"{source} failed verification, so it is not packed: {result.problems[0]}"
            + (f" (and {len(result.problems) - 1} more problems)" if len(result.problems) > 1 else "")
        )
    target = Path(output) if output else source.with_name(source.name + spec.ARCHIVE_SUFFIX)
    top = PurePosixPath(source.name)
    with atomic_file(target, binary=True) as raw:
        with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as compressed:
            with tarfile.open(fileobj=compressed, mode="w|") as tar:
                for dump in result.dumps:  # each rank dump: its directory, manifest and listed files only
                    inside = dump.path.relative_to(source).as_posix()
                    base = top / inside if inside != "." else top
                    if inside != ".":
                        tar.add(dump.path, arcname=str(base), recursive=False)
                    for name in [spec.MANIFEST, *sorted(dump.manifest["files"])]:
                        tar.add(dump.path / name, arcname=str(base / name), recursive=False)
    return target
