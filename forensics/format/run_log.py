"""The run log's format (docs/DUMP_FORMAT.md, "Run log"): how a segment is written, thinned and read back.

The Guard writes (capture/recording/run_log.py); `forensics timeline` reads (forensics/commands/timeline.py). A
segment is JSON lines: a header object, then rows (`[step, loss, grad_norm, lr, loss_scale, flags, suppressed?]`),
buckets of thinned healthy steps (`["b", first, last, n, loss_min, loss_max, gn_min, gn_max, lr_min, lr_max,
scale_min, scale_max, clipped, skipped]`) and events (`{"event": ...}`). A log comes from a job: the reader treats
it as untrusted input (sizes, counts, types, string lengths checked; a bad segment is skipped and said).
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from forensics.format.jsonio import parse_json, refusal
from forensics.format.limits import MAX_WORLD_SIZE, MiB

FORMAT_NAME = "forensics-run-log"
FORMAT_VERSION = 1
DIR_NAME = "runlogs"
"""`<dump_dir>/runlogs/<run_id>/rank-<R>/<session>/seg-<NNNNNN>.jsonl`: beside the runs' dump directories, not in
them (a run directory holds step directories only)."""

SEGMENT_ROWS = 2048
"""Steps per segment: the current one is rewritten whole at each flush (no append in object storage), so it is
kept small (about 80 KB)."""
FULL_SEGMENTS = 8
"""The newest segments kept step by step (16,384 steps); older ones are thinned to buckets."""
BUCKET_ROWS = 64
"""Healthy steps per bucket in a thinned segment (min / max of each scalar): a 1,000,000-step run is about 16,000
buckets per rank, 1.5 MB."""
MAX_SEGMENT_BYTES = 16 * MiB
"""A segment larger than this is refused by the reader (a full one with an event per step is under 2 MB)."""
MAX_SEGMENTS = 100_000
"""Segments per rank the reader reads (a million-step run has 489)."""
MAX_RANKS = 4096
"""Ranks' logs the reader reads (above it: the first MAX_RANKS ranks, said)."""
MAX_TEXT = 500
"""Characters of a string field (message, reason) kept by the reader."""
MAX_EVENTS_PER_STEP = 8
"""Events one step may hold in a segment (a step has one incident, its dump's outcome and a precursor)."""

CLIPPED, SKIPPED = 1, 2
"""Row flags."""


class EventKind(str, enum.Enum):
    """What a run log's event says."""

    TRIGGER = "trigger"
    """A detector fired (NaN/Inf, spike, precursor, exception): with the policy and whether it was dumped, or why not."""
    DUMP_WRITTEN = "dump_written"
    DUMP_FAILED = "dump_failed"
    END = "end"
    """The Guard closed: the run's dump budget (the manifest's `dump_budget`)."""


def number(value: Any) -> float | int | str | None:
    """A scalar as stored: None, a float to 7 significant digits, or "nan" / "inf" / "-inf"."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return float(f"{value:.7g}")


def parse_number(value: Any) -> float | None:
    """Reads back `number`; anything else (a string, a list, a bool) is None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(value) if isinstance(value, str) else None


def row(
    step: int,
    loss: Any,
    grad_norm: Any,
    lr: Any,
    loss_scale: Any,
    clipped: Any,
    skipped: Any,
    suppressed: str | None = None,
) -> list:
    """One step's stored row (History.append's arguments)."""
    out = [
        int(step),
        number(loss),
        number(grad_norm),
        number(lr),
        number(loss_scale),
        (CLIPPED if clipped else 0) | (SKIPPED if skipped else 0),
    ]
    if suppressed:
        out.append(str(suppressed)[:MAX_TEXT])
    return out


def _keep_whole(stored: list, event_steps: set) -> bool:
    """A row a thinned segment keeps as it is: skipped, suppressed, non-finite, or the step of an event."""
    return (
        stored[0] in event_steps
        or stored[5] & SKIPPED
        or len(stored) > 6
        or any(isinstance(v, str) for v in stored[1:5])
    )


def thin(rows: list[list], events: list[dict], bucket: int = BUCKET_ROWS) -> list[list]:
    """The rows of a segment thinned: each run of `bucket` healthy rows becomes one bucket (min / max of each
    scalar, counts of clipped and skipped steps); rows that matter (see `_keep_whole`) stay whole. Events are
    never thinned (they are kept by the caller)."""
    event_steps = {e.get("step") for e in events if isinstance(e.get("step"), int)}
    out: list[list] = []
    pending: list[list] = []

    def close() -> None:
        if not pending:
            return
        columns = [[r[i] for r in pending if isinstance(r[i], (int, float))] for i in range(1, 5)]
        span = [[min(c), max(c)] if c else [None, None] for c in columns]
        out.append(
            ["b", pending[0][0], pending[-1][0], len(pending), *[v for pair in span for v in pair]]
            + [sum(1 for r in pending if r[5] & CLIPPED), sum(1 for r in pending if r[5] & SKIPPED)]
        )
        pending.clear()

    for stored in rows:
        if _keep_whole(stored, event_steps):
            close()
            out.append(stored)
            continue
        pending.append(stored)
        if len(pending) >= bucket:
            close()
    close()
    return out


def _json(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def row_line(stored: list) -> str:
    """A stored row as its JSON line (written by hand: the writer thread encodes one per step)."""
    return "[" + ",".join(_json(v) for v in stored) + "]"


def encode_lines(header: dict, lines: list[str], events: Iterable[dict]) -> bytes:
    """A segment's bytes from its rows' lines: header line, rows, then events."""
    head = json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, **header}, separators=(",", ":"))
    tail = [json.dumps(e, separators=(",", ":"), default=str) for e in events]
    return "\n".join([head, *lines, *tail, ""]).encode()


def encode_segment(header: dict, rows: Iterable[list], events: Iterable[dict]) -> bytes:
    """A segment's bytes: header line, rows (or buckets), then events."""
    return encode_lines(header, [json.dumps(r, separators=(",", ":")) for r in rows], events)


# -- reading ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step as the run log holds it (a bucket of thinned steps: `last` > `step`, min / max in `span`)."""

    step: int
    loss: float | None
    grad_norm: float | None
    lr: float | None
    loss_scale: float | None
    clipped: bool
    skipped: bool
    suppressed: str | None = None
    last: int | None = None
    """A bucket: its last step (the values are then the maxima, `span` has the minima)."""
    span: tuple = ()
    """A bucket: (loss_min, gn_min, lr_min, scale_min)."""
    count: int = 1


@dataclass(frozen=True)
class Event:
    """One event of the run log, its fields checked (strings cut to MAX_TEXT)."""

    kind: EventKind
    step: int
    rank: int
    trigger: str | None = None
    """The trigger kind's value (TriggerKind), for TRIGGER."""
    message: str = ""
    value: float | None = None
    threshold: float | None = None
    policy: str | None = None
    dumped: bool = False
    why_not: str | None = None
    local: bool = True
    """False when this rank only followed another rank's trigger (several ranks agree on every dump)."""
    budget: dict = field(default_factory=dict)


@dataclass
class RankLog:
    """What one rank's run log holds, sorted by step."""

    rank: int
    run_id: str | None = None
    world_size: int | None = None
    steps: list[Step] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Segments that were skipped, and why."""


class SegmentError(ValueError):
    """A segment that is not a run log segment of this version, or breaks a limit."""


def _text(value: Any) -> str | None:
    return None if value is None else str(value)[:MAX_TEXT]


def _int(value: Any, what: str, low: int = 0, high: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SegmentError(f"{what} is not an integer in [{low}, {high}]")
    return value


def _step(stored: Any) -> Step:
    if not isinstance(stored, list) or not stored:
        raise SegmentError("a row is not a list")
    if stored[0] == "b":
        if len(stored) != 14:
            raise SegmentError("a bucket does not have 14 fields")
        first, last, count = (_int(v, "a bucket's step or count") for v in stored[1:4])
        v = [parse_number(x) for x in stored[4:12]]
        return Step(
            first,
            v[1],
            v[3],
            v[5],
            v[7],
            bool(_int(stored[12], "a clip count")),
            bool(_int(stored[13], "a skip count")),
            last=last,
            span=(v[0], v[2], v[4], v[6]),
            count=count,
        )
    if len(stored) not in (6, 7):
        raise SegmentError("a row does not have 6 or 7 fields")
    flags = _int(stored[5], "a row's flags", 0, 3)
    loss, grad_norm, lr, scale = (parse_number(x) for x in stored[1:5])
    return Step(
        _int(stored[0], "a step"),
        loss,
        grad_norm,
        lr,
        scale,
        clipped=bool(flags & CLIPPED),
        skipped=bool(flags & SKIPPED),
        suppressed=_text(stored[6]) if len(stored) == 7 else None,
    )


def _event(stored: dict, rank: int) -> Event:
    try:
        kind = EventKind(stored.get("event"))
    except ValueError:
        raise SegmentError(f"unknown event {_text(stored.get('event'))!r}") from None
    budget = stored.get("budget")
    return Event(
        kind,
        _int(stored.get("step"), "an event's step"),
        rank,
        trigger=_text(stored.get("trigger")),
        message=_text(stored.get("message")) or "",
        value=parse_number(stored.get("value")),
        threshold=parse_number(stored.get("threshold")),
        policy=_text(stored.get("policy")),
        dumped=stored.get("dumped") is True,
        why_not=_text(stored.get("why_not") or stored.get("error")),
        local=stored.get("local") is not False,
        budget=budget if isinstance(budget, dict) and len(json.dumps(budget, default=str)) < 64 * 1024 else {},
    )


def parse_segment(data: bytes, rank: int) -> tuple[dict, list[Step], list[Event]]:
    """One segment's header, steps and events. Raises SegmentError."""
    if len(data) > MAX_SEGMENT_BYTES:
        raise SegmentError(f"larger than {MAX_SEGMENT_BYTES} bytes")
    lines = data.decode("utf-8", "replace").splitlines()
    if not lines:
        raise SegmentError("empty")
    try:
        header = parse_json(lines[0].encode())
    except ValueError as exc:  # JSONRefused too: nesting, huge numbers, a key twice
        raise SegmentError(f"its first line is refused: {refusal(exc)}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise SegmentError(f"not a {FORMAT_NAME} segment")
    if header.get("version") != FORMAT_VERSION:
        raise SegmentError(f"version {_text(header.get('version'))}; this forensics reads version {FORMAT_VERSION}")
    if header.get("rank") != rank:
        raise SegmentError(f"its header names rank {_text(header.get('rank'))}, not {rank}")
    steps, events = [], []
    for line in lines[1:]:
        try:
            stored = parse_json(line.encode())
        except ValueError as exc:
            raise SegmentError(f"a line is refused: {refusal(exc)}") from None
        if isinstance(stored, dict):
            events.append(_event(stored, rank))
        else:
            steps.append(_step(stored))
    return header, steps, events


def merge(rank: int, segments: Iterator[tuple[str, bytes]]) -> RankLog:
    """A rank's log from its segments ((name, bytes) in session then segment order); a bad segment is skipped and
    said in `problems`; a step a later session wrote again (a resumed job) replaces the earlier one."""
    log = RankLog(rank)
    by_step: dict[int, Step] = {}
    events: dict[tuple, Event] = {}
    for count, (name, data) in enumerate(segments):
        if count >= MAX_SEGMENTS:
            log.problems.append(f"rank {rank}: more than {MAX_SEGMENTS} segments; the rest is not read")
            break
        try:
            header, steps, seg_events = parse_segment(data, rank)
        except SegmentError as exc:
            log.problems.append(f"rank {rank}: segment {name} skipped: {exc}")
            continue
        run_id, world = header.get("run_id"), header.get("world_size")
        log.run_id = _text(run_id) if log.run_id is None else log.run_id
        if isinstance(world, int) and not isinstance(world, bool) and 0 < world <= MAX_WORLD_SIZE:
            log.world_size = world
        for s in steps:
            by_step[s.step] = s
        for e in seg_events:
            events[(e.kind, e.step, e.trigger, e.message)] = e
    log.steps = [by_step[k] for k in sorted(by_step)]
    log.events = sorted(events.values(), key=lambda e: (e.step, list(EventKind).index(e.kind)))
    return log
