"""Integrity check of a dump: every file listed, present, of the right size and checksum; ranks complete."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forensics.errors import DumpError
from forensics.format import spec
from forensics.format.limits import ArchiveLimits
from forensics.format.reader import Dump, open_step


@dataclass(frozen=True)
class Problem:
    path: str  # the file (or rank directory) at fault
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass
class VerifyResult:
    dumps: list[Dump]
    missing_ranks: list[int]
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_rank(dump: Dump) -> list[Problem]:
    problems = []
    listed = dump.manifest["files"]
    for name in listed:
        try:
            dump.verify_file(name)
        except DumpError as exc:
            problems.append(Problem(str(dump.path / name), str(exc)))
    for path in sorted(dump.path.iterdir()):
        if path.is_symlink():
            problems.append(Problem(str(path), "is a symbolic link; a dump holds only plain files"))
        elif path.name != spec.MANIFEST and path.name not in listed:
            problems.append(Problem(str(path), "file is not listed in the manifest (added after the dump was written)"))
    for index in range(dump.num_micro_batches):
        for name in (spec.batch_json_name(index), spec.batch_tensors_name(index)):
            if name not in listed:
                problems.append(Problem(str(dump.path / name), "micro-batch file is missing from the manifest"))
    return problems


def verify_dump(path: str | Path, limits: ArchiveLimits | None = None) -> VerifyResult:
    """Checks a rank dump, a step directory or an archive. Raises DumpError when it cannot even be opened."""
    dumps, missing = open_step(path, limits)
    problems: list[Problem] = []
    for dump in dumps:
        problems.extend(_check_rank(dump))
    for rank in missing:
        problems.append(Problem(f"rank-{rank:05d}", "rank dump is missing (that rank did not finish writing)"))
    return VerifyResult(dumps, missing, problems)
