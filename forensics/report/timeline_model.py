"""What `forensics timeline` shows of one run: its ranks' logs, its faults across ranks, its dumps and their
verdicts (built by forensics/commands/timeline.py, drawn by forensics/report/timeline_html.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from forensics.format import run_log as fmt


@dataclass(frozen=True)
class DumpEntry:
    """One step dump of the run, and its replay's verdict when there is one."""

    step: int
    trigger: str | None
    ranks: tuple[int, ...]
    path: str
    report: str | None = None
    """report.json of its replay."""
    report_html: str | None = None
    verdict: str | None = None
    """The verdict kind (VerdictKind's value)."""
    headline: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Fault:
    """One trigger on one step, across ranks."""

    step: int
    trigger: str
    message: str
    first_ranks: tuple[int, ...]
    """The ranks that saw it themselves (the others followed them)."""
    ranks: tuple[int, ...]
    dumped: bool
    why_not: str | None
    policy: str | None
    dump: DumpEntry | None = None


@dataclass
class Timeline:
    run_id: str
    directory: str
    log_directory: str
    world_size: int | None
    ranks: list[fmt.RankLog]
    faults: list[Fault] = field(default_factory=list)
    dumps: list[DumpEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def first_step(self) -> int | None:
        starts = [r.steps[0].step for r in self.ranks if r.steps]
        return min(starts) if starts else None

    @property
    def last_step(self) -> int | None:
        ends = [r.steps[-1].last or r.steps[-1].step for r in self.ranks if r.steps]
        return max(ends) if ends else None
