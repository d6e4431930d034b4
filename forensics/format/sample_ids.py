"""Positional sample IDs: made up from a sample's place in its step, for a micro-batch recorded without IDs.

A dump names every sample. Where the job gave none (record_batch without `sample_ids`, a batch without
GuardConfig.recording.sample_id_key), the Guard writes IDs like 'step5/rank0/mb1/2' — micro-batches counted from 1, as
the text counts them — and flags the micro-batch `ids_are_positional` in the manifest; a replay of a dump that stores
no IDs makes 'step5/mb1/2', and a session built from live objects 'mb1/2'. Such an ID names a position, never a record
of the dataset: a report may name it, a blocklist never. Capture and replay both decide it here; a dump keeps the IDs
it stored (older dumps included).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def positional_ids(micro_batch: int, size: int, step: int | None = None, rank: int | None = None) -> list[str]:
    """The made-up IDs of the `size` samples of micro-batch `micro_batch` (its 0-based index), prefixed by the
    `step` and the `rank` where known: 'step5/rank0/mb1/0', 'step5/mb1/0', 'mb1/0'."""
    prefix = "".join(
        part for part, known in ((f"step{step}/", step is not None), (f"rank{rank}/", rank is not None)) if known
    )
    return [f"{prefix}mb{micro_batch + 1}/{j}" for j in range(size)]


def written_ids(
    recorded: list | None, step: int, micro_batch: int, size: int | None, rank: int
) -> tuple[list | None, bool]:
    """What the job writes for a micro-batch: the IDs it recorded (as JSON values), or, when it recorded none, IDs
    made from positions (when the size is known); and whether they are positional (manifest `ids_are_positional`)."""
    if recorded is not None:
        return recorded, False
    return (positional_ids(micro_batch, size, step, rank) if size is not None else None), True


def ids_are_positional(micro_batch: Mapping[str, Any]) -> bool:
    """Whether a manifest micro-batch entry's IDs are positional: flagged so by the job, or none stored (a replay then
    makes them from positions)."""
    return bool(micro_batch.get("ids_are_positional")) or not micro_batch.get("sample_ids")
