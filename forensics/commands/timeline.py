"""`forensics timeline`: a run at a glance, from its ranks' run logs, its dumps and their replays.

Reads `<run>/runlog/rank-*/<session>/seg-*.jsonl` (forensics/format/run_log.py: every read size-checked, a bad
segment skipped and said), lists the run's dumps with `forensics list`'s catalog (commands/catalog.py: which were
replayed and where the report is) and reads each report's verdict. It groups the ranks' trigger events into faults
(one per step and kind) and names the ranks that saw each one themselves: the first, since every other rank only
followed them (a rank's trigger that another rank handed it is `local: false`). The page and the terminal text are
rendered from the `Timeline` it returns (forensics/report/timeline_html.py, `summary_text` here).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

from forensics.commands.catalog import list_dumps
from forensics.core.errors import ForensicsError
from forensics.format import run_log as fmt
from forensics.format.location import Location, RemotePath, as_location, lstat_mode, open_read
from forensics.format.manifest import safe_name
from forensics.report.model import ReportError, load_report
from forensics.report.run_curve import RUN_PAGE
from forensics.report.timeline_model import DumpEntry, Fault, Timeline
from forensics.report.wording import clean

import stat

_RANK_DIR = re.compile(r"rank-(\d{1,7})")
_SEGMENT = re.compile(r"seg-(\d{6})\.jsonl")
_SESSION = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class TimelineError(ForensicsError):
    """RUN holds no run log (or several runs and no --run)."""


def find_runs(root: Location) -> list[tuple[Location, Location]]:
    """(run log directory, run dump directory) of each run at `root`: a dump directory (every run in its
    `runlogs/`), one run's dump directory `<dump_dir>/<run_id>`, or its log directory `<dump_dir>/runlogs/<run_id>`."""
    if root.parent.name == fmt.DIR_NAME and root.is_dir():
        return [(root, root.parent.parent / root.name)]
    logs = root.parent / fmt.DIR_NAME / root.name
    if logs.is_dir():
        return [(logs, root)]
    if (root / fmt.DIR_NAME).is_dir():
        children = sorted((c for c in (root / fmt.DIR_NAME).iterdir() if safe_name(c.name) and c.is_dir()), key=str)
        return [(c, root / c.name) for c in children]
    return []


def _segments(rank_dir: Location, problems: list[str]) -> Iterator[tuple[str, bytes]]:
    """A rank's segments, sessions in name order (they start with their start time), each size-checked first."""
    sessions: list[Location] = sorted(
        (s for s in rank_dir.iterdir() if _SESSION.fullmatch(s.name) and stat.S_ISDIR(lstat_mode(s))), key=str
    )
    for session in sessions:
        segments: list[Location] = sorted(session.iterdir(), key=str)
        for segment in segments:
            if not _SEGMENT.fullmatch(segment.name):
                continue
            if not stat.S_ISREG(lstat_mode(segment)):
                problems.append(f"{segment} is not a plain file; skipped")
                continue
            size = segment.stat().st_size
            if size > fmt.MAX_SEGMENT_BYTES:
                problems.append(f"{segment} is {size} bytes, above {fmt.MAX_SEGMENT_BYTES}; skipped")
                continue
            with open_read(segment) as f:
                yield f"{session.name}/{segment.name}", f.read(fmt.MAX_SEGMENT_BYTES + 1)


def read_rank_logs(log_dir: Location) -> tuple[list[fmt.RankLog], list[str]]:
    """Every rank's log of the run (at most MAX_RANKS), and what was skipped."""
    problems: list[str] = []
    ranks = []
    for child in log_dir.iterdir():
        match = _RANK_DIR.fullmatch(child.name)
        if match and stat.S_ISDIR(lstat_mode(child)):
            ranks.append((int(match.group(1)), child))
    ranks.sort()
    if len(ranks) > fmt.MAX_RANKS:
        problems.append(f"{len(ranks)} ranks logged; the first {fmt.MAX_RANKS} are read")
        ranks = ranks[: fmt.MAX_RANKS]
    logs = []
    for rank, directory in ranks:
        log = fmt.merge(rank, _segments(directory, problems))
        problems += log.problems
        logs.append(log)
    return logs, problems


def _dump_entries(run_dir: Location, reports: Path) -> tuple[list[DumpEntry], list[str]]:
    problems = []
    entries = []
    if not run_dir.is_dir():  # no dump yet
        return [], []
    rows, _ = list_dumps(run_dir, reports=reports)
    for row in rows:
        if row.error or row.step is None:
            problems.append(clean(f"{row.path}: unreadable: {row.error}"))
            continue
        verdict = headline = error = html = None
        if row.report:
            try:
                report = load_report(row.report)
                verdict, headline = report["verdict"]["kind"], report["verdict"]["headline"]
                candidate = Path(row.report).with_name("report.html")
                html = str(candidate) if candidate.is_file() else None
            except (ReportError, OSError) as exc:
                error = str(exc)[:300]
        entries.append(
            DumpEntry(row.step, row.trigger, tuple(row.ranks), row.path, row.report, html, verdict, headline, error)
        )
    return entries, problems


def _faults(logs: list[fmt.RankLog], dumps: list[DumpEntry]) -> list[Fault]:
    by_key: dict[tuple[int, str], list[fmt.Event]] = {}
    for log in logs:
        for event in log.events:
            if event.kind is fmt.EventKind.TRIGGER and event.trigger:
                by_key.setdefault((event.step, event.trigger), []).append(event)
    dump_at = {(d.step, d.trigger): d for d in dumps}
    faults = []
    for (step, trigger), events in sorted(by_key.items()):
        ranks = tuple(sorted({e.rank for e in events}))
        first = tuple(sorted({e.rank for e in events if e.local})) or ranks
        lead = next((e for e in events if e.local), events[0])
        dumped = any(e.dumped for e in events)
        why_not = None if dumped else next((e.why_not for e in events if e.why_not), None)
        faults.append(
            Fault(step, trigger, lead.message, first, ranks, dumped, why_not, lead.policy, dump_at.get((step, trigger)))
        )
    return faults


def build_timeline(
    run: str | os.PathLike | Location, run_id: str | None = None, reports: str | os.PathLike = "forensics_reports"
) -> Timeline:
    """Reads one run's logs, dumps and verdicts.

    Args:
        run: a run directory (`<dump_dir>/<run_id>`), or the dump directory holding it (a path or an fsspec URL).
        run_id: which run, when the dump directory holds several.
        reports: where `forensics replay` wrote reports it could not put beside the dump.
    Raises:
        TimelineError: no run log there, or several runs and no `run_id`.
    """
    root = as_location(run)
    runs = find_runs(root)
    if run_id is not None:
        if not safe_name(run_id):
            raise TimelineError(f"{run_id!r} is not a run id (letters, digits, '.', '-', '_')")
        runs = [r for r in runs if r[0].name == run_id]
    if not runs:
        raise TimelineError(
            clean(
                f"no run log under {root}: pass the Guard's dump_dir or one run directory in it "
                "(runs write one unless GuardConfig(recording=RecordConfig(run_log=False)))"
            )
        )
    if len(runs) > 1:
        names = ", ".join(clean(r[0].name) for r in runs[:20])
        raise TimelineError(f"{root} holds {len(runs)} runs ({names}): pick one with --run RUN_ID")
    log_dir, run_dir = runs[0]
    logs, problems = read_rank_logs(log_dir)
    dumps, dump_problems = _dump_entries(run_dir, Path(reports))
    worlds = [log.world_size for log in logs if log.world_size]
    run_name = log_dir.name
    timeline = Timeline(
        run_id=run_name,
        directory=str(run_dir),
        log_directory=str(log_dir),
        world_size=max(worlds) if worlds else None,
        ranks=logs,
        dumps=dumps,
        problems=problems + dump_problems,
    )
    timeline.faults = _faults(logs, dumps)
    return timeline


def default_page(t: Timeline) -> Path | None:
    """Where the run page goes without -o: beside a local run's log (each replay report links there), else None."""
    log_dir = as_location(t.log_directory)
    if isinstance(log_dir, RemotePath) or not os.access(log_dir, os.W_OK):
        return None
    return Path(log_dir) / RUN_PAGE


# -- the terminal summary -----------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return f"{value:.4g}"


def summary_text(t: Timeline) -> str:
    """What the page shows, as lines for a terminal (every string from the logs cleaned of control characters)."""
    lines = [
        clean(
            f"run {t.run_id}: {len(t.ranks)} rank(s) logged of {t.world_size or '?'}, "
            f"steps {t.first_step if t.first_step is not None else '-'}..{t.last_step if t.last_step is not None else '-'}"
        )
    ]
    for log in t.ranks:
        finite = [s.loss for s in log.steps if s.loss is not None and math.isfinite(s.loss)]
        bad = next((s.step for s in log.steps if s.loss is not None and not math.isfinite(s.loss)), None)
        lines.append(
            f"  rank {log.rank}: {sum(s.count for s in log.steps)} steps, loss "
            f"{_fmt(finite[0] if finite else None)} -> {_fmt(finite[-1] if finite else None)} "
            f"(min {_fmt(min(finite) if finite else None)})"
            + (f", first non-finite loss at step {bad}" if bad is not None else "")
        )
    if not t.faults:
        lines.append("no trigger fired")
    else:
        lines.append(f"{len(t.faults)} trigger(s):")
        lines.append(f"  {'step':>8}  {'trigger':<16} {'first seen by':<14} {'dumped':<7} verdict, or why not dumped")
        for f in t.faults:
            first = ",".join(str(r) for r in f.first_ranks[:6]) + ("..." if len(f.first_ranks) > 6 else "")
            dumped = "yes" if f.dumped else "no"
            verdict = f.why_not or "?"
            if f.dump is not None and f.dump.verdict:
                verdict = f"{f.dump.verdict}: {f.dump.headline or ''}"
            elif f.dump is not None:
                verdict = f"not replayed: forensics replay {f.dump.path}"
            elif f.dumped:
                verdict = "no dump on disk now (replaced by a larger spike, or its write failed)"
            lines.append(clean(f"  {f.step:>8}  {f.trigger:<16} rank {first:<9} {dumped:<7} {verdict[:140]}"))
    lines += [clean(f"note: {p}") for p in t.problems[:20]]
    return "\n".join(lines)
