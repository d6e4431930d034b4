"""Safe unpacking of a `.tar.zst` dump archive into a temporary directory (what every reader does with one).

Members are extracted with tarfile's "data" filter (no absolute paths, no '..', nothing outside the
destination, no special files, safe permissions), and only regular files and directories are
accepted: a dump holds nothing else.
"""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path

import zstandard

from forensics.errors import DumpCorruptError, NotADumpError
from forensics.format import spec


def _dump_members(tar: tarfile.TarFile):
    for member in tar:
        if member.name.startswith("/"):  # the data filter would strip the "/" and extract it inside: refuse
            raise DumpCorruptError(f"archive member {member.name!r} escapes the archive (absolute path); "
                                   "refusing to unpack")
        if not (member.isfile() or member.isdir()):
            raise DumpCorruptError(f"archive member {member.name!r} is a link or device; refusing to unpack")
        yield member


def unpack_archive(path: Path) -> tuple[Path, tempfile.TemporaryDirectory]:
    """Unpacks into a temporary directory; returns the dump directory and the holder keeping it alive."""
    if not hasattr(tarfile, "data_filter"):
        raise DumpCorruptError(f"reading {path} needs tarfile's data filter (Python >= 3.10.12 / 3.11.4 / 3.12); "
                               "upgrade Python, or unpack the archive by hand and pass the directory")
    holder = tempfile.TemporaryDirectory(prefix="forensics-")
    root = Path(holder.name)
    try:
        with open(path, "rb") as raw:
            with zstandard.ZstdDecompressor().stream_reader(raw) as stream:
                with tarfile.open(fileobj=stream, mode="r|") as tar:
                    for member in _dump_members(tar):
                        tar.extract(member, root, set_attrs=False, filter="data")
    except tarfile.FilterError as exc:
        holder.cleanup()
        raise DumpCorruptError(f"archive member {exc.tarinfo.name!r} escapes the archive ({exc}); "
                               "refusing to unpack") from exc
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
