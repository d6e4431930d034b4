"""`forensics pack`: a dump directory (rank or step) as one `.tar.zst` for job artifacts."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path, PurePosixPath

import zstandard

from forensics.core.errors import DumpCorruptError, ForensicsError, NotADumpError
from forensics.core.redact import redacted_environment
from forensics.format import jsonio, spec
from forensics.format.limits import MAX_JSON_FILE
from forensics.format.reader import Dump, is_rank_dump
from forensics.format.verify import verify_dump
from forensics.core.fsio import atomic_file
from forensics.format.location import Location, RemotePath, as_location, file_size, open_read
from forensics.format.manifest import safe_name


def pack_dump(
    path: str | Path | Location, output: str | Path | None = None, *, rank_part: bool = False, force: bool = False
) -> Path:
    """Packs a dump directory (rank or step; on disk or at an fsspec URL) into one `.tar.zst`; returns the archive
    path (beside the dump; for a dump in object storage, in the current directory as
    `<run>-step<N>[-rank<R>].tar.zst`, unless `output` says where). What is packed is what was verified (a dump in
    object storage: its verified local copies, forensics.format.spool).

    One rank of a sharded dump is refused (alone it replays nothing) unless `rank_part` (a rank uploading its
    own part: the tracker then holds every rank's archive). An existing file is never replaced unless `force`.

    Raises:
        ArchiveExistsError: the archive's path holds a file already (and not `force`).

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
    result = verify_dump(source, whole_state=not rank_part, keep_copies=True)  # refuses what a reader would
    if not result.ok:
        raise DumpCorruptError(
            f"{source} failed verification, so it is not packed: {result.problems[0]}"
            + (f" (and {len(result.problems) - 1} more problems)" if len(result.problems) > 1 else "")
        )
    if output:
        target = Path(output)
    elif isinstance(source, RemotePath):
        target = Path(_archive_name(result.dumps, whole_step=not is_rank_dump(source)))
    else:
        target = source.with_name(source.name + spec.ARCHIVE_SUFFIX)
    if not force and (target.exists() or target.is_symlink()):
        raise ArchiveExistsError(
            f"{target} exists already and is not replaced: pass --force (force=True) to replace it, or -o PATH to "
            "write the archive elsewhere"
        )
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
                        readable = dump.verify_file(name)
                        with open_read(readable) as handle:
                            tar.addfile(_entry(str(base / name), tarfile.REGTYPE, file_size(readable)), handle)
                    dump.close()  # object storage: its local copies are packed
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


class ArchiveExistsError(ForensicsError):
    """`pack` would replace an existing file without being told to."""


def _archive_name(dumps: list[Dump], whole_step: bool) -> str:
    """`<run>-step<N>.tar.zst` for a step, `<run>-step<N>-rank<R>.tar.zst` for one rank dump (the run id only when it
    is a plain name: it comes from the dump)."""
    first = dumps[0]
    run = first.manifest["run_id"] if safe_name(first.manifest["run_id"]) else "run"
    rank = "" if whole_step else f"-rank{first.rank}"
    return f"{run}-step{first.step}{rank}{spec.ARCHIVE_SUFFIX}"


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
