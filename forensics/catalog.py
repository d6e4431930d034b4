"""`forensics list`: every dump under a dump directory, with what a person triaging them needs to know.

One row per step dump (`<dump_dir>/<run>/step-<N>/`): run, step, trigger, ranks present of the world size,
size on disk, whether verify passed (only with `verify=True`: it hashes every file), whether a report
exists; plus the unfinished `.tmp-*` directories of killed writers (forensics/format/stale.py).
Only manifests are read; a damaged dump is listed with its error, never skipped silently.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forensics.errors import DumpError
from forensics.format import spec
from forensics.format.manifest import safe_name
from forensics.format.reader import open_step
from forensics.format.stale import stale_temporaries

REPORTS_DIR = "forensics_reports"
"""Where `forensics replay` writes reports by default (one folder per run, step and rank)."""


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


def list_dumps(root: str | os.PathLike, *, verify: bool = False,
               reports: str | os.PathLike = REPORTS_DIR) -> tuple[list[Listed], list[Path]]:
    """Lists the step dumps under `root` (a dump directory, a run directory or a step directory).

    Args:
        root: where the Guard writes (`GuardConfig.dump_dir`), or one run / step directory in it.
        verify: also check every file's size and sha256 (reads everything).
        reports: where `forensics replay` wrote reports (its default), to tell replayed dumps.
    Returns:
        (rows sorted by run and step, stale `.tmp-*` directories of writers that are gone).
    """
    from forensics.format.verify import verify_dump

    root = Path(root)
    manifests = [root / spec.MANIFEST] if (root / spec.MANIFEST).is_file() else root.rglob(spec.MANIFEST)
    steps = sorted({m.parent.parent if m.parent.name.startswith("rank-") and m.parent.parent.name.startswith("step-")
                    else m.parent for m in manifests})
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
        row.trigger = str(first.trigger.get("kind"))
        row.ranks = sorted(d.rank for d in dumps)
        row.bytes = sum(d.total_size() for d in dumps)
        if verify:
            try:
                row.verified = verify_dump(step_dir).ok
            except DumpError:
                row.verified = False
        row.report = _report_for(Path(reports), row.run_id, row.step, row.ranks)
        rows.append(row)
    rows.sort(key=lambda r: (r.run_id or "", r.step if r.step is not None else -1, r.path))
    return rows, stale_temporaries(root)


def _report_for(reports: Path, run_id: str | None, step: int | None, ranks: list[int]) -> str | None:
    if not safe_name(run_id) or step is None:
        return None
    for rank in ranks:
        candidate = reports / f"{run_id}-step{step}-rank{rank}" / "report.json"
        if candidate.is_file():
            return str(candidate)
    return None
