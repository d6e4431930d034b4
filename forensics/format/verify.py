"""Integrity check of a dump: every file listed, present, of the right size and checksum; ranks complete."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forensics.core.errors import DumpError
from forensics.format import spec
from forensics.format.limits import ArchiveLimits
from forensics.format.location import Location, as_location
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
    state_whole: bool = False
    """A sharded dump whose rank dumps found hold every part of the state (replicas or buddy copies included)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def only_ranks_missing(self) -> bool:
        """Every problem is a missing rank dump, and the state is whole without it: the other ranks replay."""
        return self.state_whole and len(self.problems) == len(self.missing_ranks) > 0


def _check_rank(dump: Dump) -> list[Problem]:
    problems = []
    listed = dump.manifest["files"]
    dump.start_verifying(listed)
    for name in listed:
        try:
            dump.check_structure(name)
        except DumpError as exc:
            problems.append(Problem(str(dump.path / name), str(exc)))
    children: Iterable[Location] = dump.path.iterdir()
    for path in sorted(children, key=str):
        if path.is_symlink():
            problems.append(Problem(str(path), "is a symbolic link; a dump holds only plain files"))
        elif path.name != spec.MANIFEST and path.name not in listed:
            problems.append(Problem(str(path), "file is not listed in the manifest (added after the dump was written)"))
    for index in range(dump.num_micro_batches):
        for name in (spec.batch_json_name(index), spec.batch_tensors_name(index)):
            if name not in listed:
                problems.append(Problem(str(dump.path / name), "micro-batch file is missing from the manifest"))
    return problems


@dataclass(frozen=True)
class Damage:
    """An optional part of a rank dump found damaged before a replay, and left out of it."""

    file: str
    """The damaged file (a listed name)."""
    problem: str
    lost: str
    """What that part would have told, in words: the replay goes on without it."""

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "problem": self.problem, "lost": self.lost}


FLIGHT_RECORDER = (spec.WINDOW_JSON, spec.WINDOW_RNG)


def _optional_part(dump: Dump, name: str) -> tuple[tuple[str, ...], str] | None:
    """The files of the optional part `name` belongs to and what the part tells (None: an essential file)."""
    if name in FLIGHT_RECORDER:
        return FLIGHT_RECORDER, "the flight recorder (the steps before this one): the window replay is skipped"
    if name in spec.SNAPSHOT_STATE:
        return tuple(spec.SNAPSHOT_STATE), (
            "the Guard's host snapshot of an earlier step: the window replay from it is skipped"
        )
    if name == spec.MAIN_SCRIPT:
        return (name,), (
            "the training script's source: a loss or model factory defined in it is named with --loss / "
            "--factory instead"
        )
    copy = ((dump.manifest.get("layout") or {}).get("copies") or {}).get(name)
    if copy is not None:
        return (name,), (
            f"the buddy copy of rank {copy['rank']}'s shards: it is used only where that rank's own dump is missing"
        )
    return None


def set_aside_damaged(dump: Dump) -> list[Damage]:
    """Before a replay: verifies every file the manifest lists (size and sha256, as `verify` does; a link, FIFO or
    device is refused without being opened). A damaged optional part (the flight recorder, the host snapshot, a
    buddy copy) is set aside with all its files, so the dump reads as one without it, and described.

    An essential file with chunk digests (the state's safetensors) is only checked for its size and kind here: its
    chunks are verified on every core in the background while replay streams it (no tensor is handed on before
    its chunks matched), so a large dump is read once, not hashed whole first; `finish_verifying` waits for the
    rest of it before the report is given.

    Raises:
        DumpCorruptError: an essential file is damaged, missing or not a regular file (naming it).
    """
    damaged = []
    dump.start_verifying(name for name in dump.manifest["files"] if name not in dump.set_aside and not _read_late(name))
    for name in dump.manifest["files"]:
        if name in dump.set_aside:
            continue
        if _optional_part(dump, name) is None and dump.manifest["files"][name].get("chunks"):
            dump.check_listed(name)  # its contents: while it streams, and in full by finish_verifying
            continue
        try:
            dump.verify_file(name)
        except DumpError as exc:
            part = _optional_part(dump, name)
            if part is None:
                raise
            files, lost = part
            dump.set_aside.update({file: f"{name} is damaged ({exc})" for file in files if dump.has_file(file)})
            damaged.append(Damage(name, str(exc), lost))
    return damaged


def _read_late(name: str) -> bool:
    """An optimizer state file: replay reads it last, if at all (the optimizer checks), so its chunks are hashed
    after the model's (verify_the_rest) instead of competing with the load for the cores: a 7B model's AdamW
    moments are twice its weights."""
    return name == spec.OPTIMIZER_TENSORS or name.endswith("-" + spec.OPTIMIZER_TENSORS)  # the host snapshot's, a
    # buddy copy of another rank's (spec.SNAPSHOT_STATE, spec.copy_file_name)


def verify_the_rest(dump: Dump) -> None:
    """Once the state is loaded: starts hashing the dump's files not yet verified (the optimizer state) in the
    background, while the replay runs its passes; finish_verifying waits for them."""
    dump.start_verifying(name for name in dump.manifest["files"] if name not in dump.set_aside)


def finish_verifying(dump: Dump) -> None:
    """After a replay, before its report: every listed file not set aside has matched its digests (the parts of the
    state replay never read included; those it read were verified as they streamed, and are not hashed again).

    Raises:
        DumpCorruptError: a file is damaged (naming it): the replay's findings would rest on it.
    """
    for name in dump.manifest["files"]:
        if name not in dump.set_aside:
            dump.verify_file(name)


def _check_shards(dumps: list[Dump]) -> list[Problem]:
    """Sharded layout: do the rank dumps found hold every part of every tensor of the state? Names the
    tensors that have gaps (from the manifests alone)."""
    from forensics.format.shards import ShardIndex

    try:
        index = ShardIndex(dumps)
        gaps = index.missing()
    except DumpError as exc:
        return [Problem(str(dumps[0].path.parent), str(exc))]
    problems = []
    for file, names in gaps.items():
        shown = ", ".join(repr(n)[:120] for n in names[:20]) + (
            f" and {len(names) - 20} more" if len(names) > 20 else ""
        )
        problems.append(
            Problem(
                file,
                f"{len(names)} tensors have parts no rank dump holds (a rank dump is missing "
                f"or died while writing): {shown}",
            )
        )
    return problems


def verify_dump(
    path: str | Path | Location,
    limits: ArchiveLimits | None = None,
    shard_dirs: Sequence[str | Path | Location] = (),
    whole_state: bool = True,
    keep_copies: bool = False,
) -> VerifyResult:
    """Checks a rank dump, a step directory or an archive (and, for a sharded dump, that the rank dumps found
    hold the complete state; `shard_dirs`: other nodes' directories of the same step; `whole_state=False`:
    only the files of the dumps under `path`). Raises DumpError when it cannot even be opened.

    In object storage each rank dump's verified local copies (forensics.format.spool) are deleted once it is
    checked, so a step of many ranks never lies on this disk whole; `keep_copies` keeps them for a caller that
    reads the files next (`pack`)."""
    dumps, missing = open_step(path, limits)
    whole_state = whole_state and dumps[0].sharded
    if whole_state:
        dumps[0].shard_dirs = [as_location(d) for d in shard_dirs]
        dumps = sorted({d.rank: d for d in [*dumps, *dumps[0].peers()]}.values(), key=lambda d: d.rank)
        missing = sorted(set(range(dumps[0].world_size)) - {d.rank for d in dumps})
    problems: list[Problem] = []
    for dump in dumps:
        problems.extend(_check_rank(dump))
        if not keep_copies:
            dump.close()
    gaps = _check_shards(dumps) if whole_state else []
    covered = (
        "; the state is complete without it (other ranks also wrote its part): replay another rank"
        if whole_state and not gaps
        else ""
    )
    for rank in missing:
        problems.append(
            Problem(f"rank-{rank:05d}", f"rank dump is missing (that rank did not finish writing){covered}")
        )
    problems.extend(gaps)
    return VerifyResult(dumps, missing, problems, state_whole=whole_state and not gaps)
