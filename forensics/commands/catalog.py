"""`forensics list`: every dump under a dump directory, with what a person triaging them needs to know.

One row per step dump (`<dump_dir>/<run>/step-<N>/`): run, step, trigger, ranks present of the world size,
size on disk, whether verify passed (only with `verify=True`: it hashes every file), whether a report
exists and where; plus the unfinished `.tmp-*` directories of killed writers (forensics/format/stale.py).
Only manifests are read; a damaged dump is listed with its error, never skipped silently.

How a report is found: `forensics replay` writes its report, by default, into the step directory
(`<step dir>/report-rank<R>/`), and wherever it wrote it (`-o DIR` included) it appends the report's path to
`<step dir>/replays.jsonl` (REPLAYS_NOTE). Both live beside the rank directories, never in them, so the
dump's checksummed files are untouched and `forensics verify` does not see them. A dump given as an archive
(or a step directory that cannot be written) gets its report under ./forensics_reports/ instead, which
`forensics list --reports DIR` also searches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forensics.core.errors import DumpError
from forensics.format import spec
from forensics.format.location import Location, RemotePath, as_location, is_url
from forensics.format.manifest import safe_name
from forensics.format.reader import open_step
from forensics.format.stale import stale_temporaries

log = logging.getLogger(__name__)

REPLAYS_NOTE = "replays.jsonl"
"""In a step directory, beside its rank directories: one JSON line per replay, {"rank", "report"}."""
REPLAYS_NOTE_TAIL = 64 << 10
"""Bytes read from the end of a step directory's REPLAYS_NOTE (the newest replays; it comes with the dump)."""

REPORTS_DIR = "forensics_reports"
"""Where `forensics replay` writes a report when the dump's own step directory is not writable (an archive, a
read-only artifact store, object storage): one folder per dump and rank under the current directory
(report_dir_name)."""


def report_dir_name(run_id: object, step: int | None, rank: int, dump_path: str | os.PathLike | Location) -> str:
    """`<run>-step<N>-rank<R>-<where>`: the folder under REPORTS_DIR of a dump's report, `<where>` the first 10 hex
    digits of the sha256 of the dump's step directory (its URL, bucket and key, or its absolute path), so dumps of
    the same run, step and rank in two buckets or two directories never share one (the run id only when it is a
    plain name: it comes from the dump)."""
    run = run_id if safe_name(run_id) else "run"
    where = hashlib.sha256(_step_location(dump_path).encode("utf-8", "surrogateescape")).hexdigest()[:10]
    return f"{run}-step{int(step or 0)}-rank{int(rank)}-{where}"


def _step_location(dump_path: str | os.PathLike | Location) -> str:
    """The step directory a dump path names (a rank directory's parent), as one string whichever way it was
    spelled: a URL as `protocol://bucket/key`, a local path absolute."""
    if isinstance(dump_path, RemotePath) or is_url(str(dump_path)):
        try:
            location = as_location(dump_path if isinstance(dump_path, RemotePath) else str(dump_path))
        except DumpError:
            return str(dump_path).rstrip("/")
        if spec.rank_of_dir_name(location.name) is not None and location.parent.name.startswith("step-"):
            location = location.parent
        return str(location)
    path = Path(dump_path)
    return str((step_dir_of(path) or path).resolve())


@dataclass
class Listed:
    """One step dump as `forensics list` shows it."""

    path: str
    run_id: str | None = None
    step: int | None = None
    trigger: str | None = None
    ranks: list[int] = field(default_factory=list)
    world_size: int | None = None
    bytes: int = 0
    verified: bool | None = None
    """True / False after verify; None: not checked."""
    report: str | None = None
    """The report.json of this dump's replay, when one is found."""
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def list_dumps(
    root: str | os.PathLike | Location, *, verify: bool = False, reports: str | os.PathLike = REPORTS_DIR
) -> tuple[list[Listed], list[Path]]:
    """Lists the step dumps under `root` (a dump directory, a run directory or a step directory).

    Args:
        root: where the Guard writes (`GuardConfig.dump_dir`: a directory or an fsspec URL), or one run / step
            directory in it. In object storage, one recursive listing finds every manifest.
        verify: also check every file's size and sha256 (reads everything).
        reports: where `forensics replay` wrote reports (its default), to tell replayed dumps.
    Returns:
        (rows sorted by run and step, stale `.tmp-*` directories of writers that are gone).
    """
    from forensics.format.verify import verify_dump

    root = as_location(root)
    manifests: Iterable[Location] = (
        [root / spec.MANIFEST] if (root / spec.MANIFEST).is_file() else root.rglob(spec.MANIFEST)
    )
    steps = sorted(
        {
            m.parent.parent
            if m.parent.name.startswith("rank-") and m.parent.parent.name.startswith("step-")
            else m.parent
            for m in manifests
        },
        key=str,
    )
    rows = []
    for step_dir in steps:
        row = Listed(path=str(step_dir))
        try:
            dumps, missing = open_step(step_dir)
        except DumpError as exc:
            row.error = str(exc)[:300]
            rows.append(row)
            continue
        first = dumps[0]
        row.run_id, row.step, row.world_size = first.manifest["run_id"], first.step, first.world_size
        row.trigger = first.trigger.kind.value
        row.ranks = sorted(d.rank for d in dumps)
        row.bytes = sum(d.total_size() for d in dumps)
        if verify:
            try:
                row.verified = verify_dump(step_dir).ok
            except DumpError:
                row.verified = False
        row.report = _report_for(Path(reports), row.run_id, row.step, row.ranks, step_dir)
        rows.append(row)
    rows.sort(key=lambda r: (r.run_id or "", r.step if r.step is not None else -1, r.path))
    return rows, [] if isinstance(root, RemotePath) else stale_temporaries(root)  # a store has no temporaries


def step_dir_of(dump_path: str | os.PathLike | Location | None) -> Path | None:
    """The step directory (holding rank-* directories) of a replayed dump path, or None (an archive, a lone rank
    directory, a path that is gone, a dump in object storage: its reports go under ./forensics_reports/)."""
    if not dump_path or isinstance(dump_path, RemotePath) or is_url(str(dump_path)):
        return None
    path = Path(dump_path)
    if path.is_dir() and any(path.glob("rank-*")):
        return path
    if path.is_dir() and path.name.startswith("rank-") and path.parent.name.startswith("step-"):
        return path.parent
    return None


def default_report_dir(dump_path: str | os.PathLike | Location | None, rank: int) -> Path | None:
    """`<step dir>/report-rank<R>` when the dump is a step / rank directory (None: the caller's fallback). A
    `report-rank<R>` already there that is not a plain directory (a link a crafted step directory holds, into its
    rank dump or anywhere else) is never written through: None."""
    step_dir = step_dir_of(dump_path)
    if step_dir is None or not os.access(step_dir, os.W_OK):
        return None
    target = step_dir / f"report-rank{int(rank)}"
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        log.warning("%s is not a plain directory: the report goes under ./%s instead", target, REPORTS_DIR)
        return None
    return target


def note_report(dump_path: str | os.PathLike | Location | None, rank: int, report_json: str | os.PathLike) -> None:
    """Appends where the report of this replay went to the step directory's REPLAYS_NOTE (best effort: a dump that
    cannot be written is only logged)."""
    step_dir = step_dir_of(dump_path)
    if step_dir is None:
        return
    line = json.dumps({"rank": int(rank), "report": str(Path(report_json).resolve())}) + "\n"
    try:  # never through a link, never into anything but a plain file (the step directory comes with the dump)
        fd = os.open(
            step_dir / REPLAYS_NOTE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666
        )  # O_NONBLOCK: a FIFO there fails at once instead of waiting for a reader
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{REPLAYS_NOTE} is not a plain file")
            f.write(line)
    except OSError as exc:
        log.info("could not note the report in %s: %s", step_dir, exc)


def _noted(step_dir: Path) -> str | None:
    """The newest report noted in the step directory that still exists (only the note's last REPLAYS_NOTE_TAIL
    bytes are read, never through a link)."""
    try:
        fd = os.open(step_dir / REPLAYS_NOTE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return None
            f.seek(max(0, info.st_size - REPLAYS_NOTE_TAIL))
            lines = f.read(REPLAYS_NOTE_TAIL).decode("utf-8", "replace").splitlines()[-100:]
    except OSError:
        return None
    for line in reversed(lines):
        try:
            report = json.loads(line).get("report")
        except (ValueError, AttributeError):
            continue
        if isinstance(report, str) and Path(report).is_file():
            return report
    return None


def _report_for(
    reports: Path, run_id: str | None, step: int | None, ranks: list[int], step_location: Location
) -> str | None:
    """The report of the dump at `step_location`: noted in (or beside the ranks of) its step directory on disk, else
    its own folder under `reports` (report_dir_name: never another dump's of the same run, step and rank)."""
    step_dir = step_dir_of(step_location)
    if step_dir is not None:
        noted = _noted(step_dir) or next((str(p) for p in sorted(step_dir.glob("report-rank*/report.json"))), None)
        if noted:
            return noted
    if step is None:
        return None
    for rank in ranks:
        candidate = reports / report_dir_name(run_id, step, rank, step_location) / "report.json"
        if candidate.is_file():
            return str(candidate)
    return None
