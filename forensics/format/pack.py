"""`forensics pack`: a dump directory (rank or step) as one `.tar.zst` for job artifacts."""

from __future__ import annotations

import tarfile
from pathlib import Path, PurePosixPath

import zstandard

from forensics.errors import NotADumpError
from forensics.format import spec
from forensics.format.reader import open_step
from forensics.fsio import atomic_file


def pack_dump(path: str | Path, output: str | Path | None = None) -> Path:
    """Packs a dump directory (rank or step) into one `.tar.zst`; returns the archive path.

    Example:
        >>> pack_dump("crash_dumps/run/step-000000042")  # doctest: +SKIP
        PosixPath('crash_dumps/run/step-000000042.tar.zst')
    """
    source = Path(path)
    if not source.is_dir():
        raise NotADumpError(f"{source} is not a dump directory; pack takes a rank or step directory")
    open_step(source)  # refuses anything that is not a complete dump
    target = Path(output) if output else source.with_name(source.name + spec.ARCHIVE_SUFFIX)
    with atomic_file(target, binary=True) as raw:
        with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as compressed:
            with tarfile.open(fileobj=compressed, mode="w|") as tar:
                for file in sorted(source.rglob("*")):
                    if any(p.startswith(".tmp-") for p in file.relative_to(source).parts):
                        continue
                    tar.add(file, arcname=str(PurePosixPath(source.name) / file.relative_to(source).as_posix()),
                            recursive=False)
    return target
