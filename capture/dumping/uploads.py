"""After a dump is written: pack it and send it to the trackers GuardConfig.dumping.upload names (forensics/core/uploads.py).
Never raises: a failed upload is logged, the dump stays on disk."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from forensics.format import spec
from forensics.format.location import Location, RemotePath
from forensics.format.pack import pack_dump
from forensics.format.reader import open_dump
from forensics.core.uploads import upload

log = logging.getLogger(__name__)


def _archive_path(path: Location) -> Path:
    """Beside a dump on disk; for one in object storage, in this machine's temporary directory (the tracker keeps
    the copy)."""
    if isinstance(path, RemotePath):
        return Path(tempfile.mkdtemp(prefix="forensics-upload-")) / (path.name + spec.ARCHIVE_SUFFIX)
    return path.with_name(path.name + spec.ARCHIVE_SUFFIX)


def send_dump(path: Location, trackers: tuple[str, ...], tensorboard_dir: str | None) -> list[str]:
    """Packs the rank dump at `path` into `<path>.tar.zst` and uploads it; returns where it went."""
    sent: list[str] = []
    try:
        dump = open_dump(path)
        archive = pack_dump(path, _archive_path(path), rank_part=True, force=True)  # its own archive, made again
        name = f"{dump.manifest['run_id']}-step{dump.step}-rank{dump.rank}"
        summary = {
            "run_id": dump.manifest["run_id"],
            "step": dump.step,
            "rank": dump.rank,
            "trigger": dump.trigger.kind.value,
            "detail": dump.trigger.message,  # micro-batches numbered from 1, as in every sentence
            "path": str(path),
            "archive": str(archive),
        }
    except Exception:
        log.exception("forensics: packing %s for upload failed; the dump stays where it is", path)
        return sent
    for tracker in trackers:
        try:
            sent.append(upload(tracker, [archive], name, "dump", summary, tensorboard_dir))
            log.warning("forensics: dump uploaded: %s", sent[-1])
        except Exception as exc:  # noqa: BLE001 - an upload never stops the job
            log.error("forensics: uploading %s to %s failed: %s", path, tracker, exc)
    return sent
