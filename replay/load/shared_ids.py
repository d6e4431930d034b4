"""Sample IDs that name more than one sample of a step (a loader that repeats IDs, a bad record carrying good ones' ID).

The replay blames positions (SampleRef compares by micro-batch and index), so a shared ID never makes an innocent
sample a culprit; this module finds the shared IDs once, for the report's warning and for the culprit block, which
names, for each blamed sample whose ID is shared, the other positions carrying it (`shared_with`): a blocklist never
lists such an ID (filtering it would drop those samples too; forensics.report.write.blocklist_ids).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from forensics.report.wording import fmt_id

MAX_SHOWN = 8  # shared IDs, and positions of one, named in words; the report's JSON keeps the count


@dataclass(frozen=True)
class SharedId:
    """An ID carried by two or more samples of the step, and where: (micro-batch, index) pairs in step order."""

    sample_id: Any
    positions: tuple[tuple[int, int], ...]


def id_key(sample_id: Any) -> str:
    """A sample ID as a comparable key (IDs are JSON values; 1 and "1" differ), as the blocklist compares them."""
    return json.dumps(sample_id, sort_keys=True, default=repr)


def shared_ids(sample_ids: Sequence[Any], skip: frozenset[int] | set[int] = frozenset()) -> list[SharedId]:
    """The IDs of `sample_ids` (one list per micro-batch) found at two or more positions; micro-batches in `skip`
    (IDs made up from positions) and None IDs are left out."""
    where: dict[str, list[tuple[int, int]]] = {}
    value: dict[str, Any] = {}
    for micro_batch, ids in enumerate(sample_ids):
        if micro_batch in skip or not isinstance(ids, (list, tuple)):
            continue
        for index, sid in enumerate(ids):
            if sid is None:
                continue
            key = id_key(sid)
            where.setdefault(key, []).append((micro_batch, index))
            value.setdefault(key, sid)
    return [SharedId(value[key], tuple(spots)) for key, spots in where.items() if len(spots) > 1]


def positions_words(positions: Sequence[tuple[int, int]]) -> str:
    """'micro-batch 1 samples 1 and 5, micro-batch 3 sample 0' (micro-batches counted from 1 as the report counts them; at most MAX_SHOWN positions)."""
    by_batch: dict[int, list[int]] = {}
    for micro_batch, index in positions[:MAX_SHOWN]:
        by_batch.setdefault(micro_batch, []).append(index)
    parts = []
    for micro_batch, indices in by_batch.items():
        listed = ", ".join(map(str, indices[:-1])) + f" and {indices[-1]}" if len(indices) > 1 else str(indices[0])
        parts.append(f"micro-batch {micro_batch + 1} sample{'s' if len(indices) > 1 else ''} {listed}")
    more = f" and {len(positions) - MAX_SHOWN} more" if len(positions) > MAX_SHOWN else ""
    return ", ".join(parts) + more


def shared_ids_warning(shared: Sequence[SharedId]) -> str | None:
    """The report's warning: which IDs name several samples, where, and what the replay does about it."""
    if not shared:
        return None
    named = "; ".join(f"{fmt_id(s.sample_id, 80)} at {positions_words(s.positions)}" for s in shared[:MAX_SHOWN])
    more = f" (and {len(shared) - MAX_SHOWN} more IDs)" if len(shared) > MAX_SHOWN else ""
    return (
        f"{len(shared)} sample ID(s) name more than one sample of this step: {named}{more}. The replay blames samples "
        "by position, and no blocklist lists an ID that also names a sample it does not blame. Give each record its "
        "own ID."
    )


__all__ = ["SharedId", "id_key", "positions_words", "shared_ids", "shared_ids_warning"]
