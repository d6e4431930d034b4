"""`forensics pack`: a dump directory (rank or step) as one `.tar.zst` for job artifacts."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path, PurePosixPath

import zstandard

from forensics.core.errors import DumpCorruptError, NotADumpError
from forensics.core.redact import redacted_environment
from forensics.format import jsonio, spec
from forensics.format.limits import MAX_JSON_FILE
from forensics.format.reader import Dump, is_rank_dump
from forensics.format.verify import verify_dump
from forensics.core.fsio import atomic_file
from forensics.format.location import Location, RemotePath, as_location, file_size, open_read


def pack_dump(path: str | Path | Location, output: str | Path | None = None, *, rank_part: bool = False) -> Path:
    """Packs a dump directory (rank or step; on disk or at an fsspec URL) into one `.tar.zst`; returns the archive
    path (beside the dump; for a dump in object storage, in the current directory unless `output` says where).

    One rank of a sharded dump is refused (alone it replays nothing) unless `rank_part` (a rank uploading its
    own part: the tracker then holds every rank's archive).

    Example:
        >>> pack_dump("crash_dumps/run/step-000000042")  # doctest: +SKIP
        PosixPath('crash_dumps/run/step-000000042.tar.zst')
    """
    source = as_location(path)
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
    if output:
        target = Path(output)
    elif isinstance(source, RemotePath):
        target = Path(source.name + spec.ARCHIVE_SUFFIX)
    else:
        target = source.with_name(source.name + spec.ARCHIVE_SUFFIX)
    top = PurePosixPath(source.name)
    with atomic_file(target, binary=True) as raw:
        with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as compressed:
            with tarfile.open(fileobj=compressed, mode="w|") as tar:
                for dump in result.dumps:  # each rank dump: its directory, manifest and listed files only
                    inside = _inside(dump.path, source)
                    base = top / inside if inside != "." else top
                    if inside != ".":
                        tar.addfile(_entry(str(base), tarfile.DIRTYPE))
                    manifest = _manifest_bytes(dump.path / spec.MANIFEST)
                    tar.addfile(_entry(str(base / spec.MANIFEST), tarfile.REGTYPE, len(manifest)), io.BytesIO(manifest))
                    for name in sorted(dump.manifest["files"]):
                        with open_read(dump.path / name) as handle:
                            tar.addfile(_entry(str(base / name), tarfile.REGTYPE, file_size(dump.path / name)), handle)
    return target


def _manifest_bytes(path: Location) -> bytes:
    """The manifest as the archive holds it: its bytes, or, for a dump written before a credential's form was known,
    the same JSON with the command line redacted (forensics.core.redact; the manifest is listed in no checksum)."""
    with open_read(path) as handle:
        raw = handle.read(MAX_JSON_FILE + 1)
    if len(raw) > MAX_JSON_FILE:
        raise DumpCorruptError(f"{path} is over {MAX_JSON_FILE} bytes; a manifest is at most that", spec.MANIFEST)
    manifest = jsonio.parse_json(raw)  # verify_dump read it already: valid JSON within the limits
    environment = manifest.get("environment")
    redacted = redacted_environment(environment)
    if redacted == environment:
        return bytes(raw)
    return jsonio.dumps({**manifest, "environment": redacted})


def _inside(path: Location, source: Location) -> str:
    if isinstance(path, RemotePath) and isinstance(source, RemotePath):
        return path.relative_to(source).as_posix()
    if isinstance(path, Path) and isinstance(source, Path):
        return path.relative_to(source).as_posix()
    raise ValueError(f"{path} is not inside {source}")


def _entry(name: str, kind: bytes, size: int = 0) -> tarfile.TarInfo:
    """A member as `pack` writes it: a plain file or directory, of no owner, read-only (`tar` of a dump in object
    storage and on disk give the same archive)."""
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode = kind, size, 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info
