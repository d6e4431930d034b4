"""Sample sizes of a step, for out-of-memory failures: which samples are far larger than the others.

A sample's size is its token count: the ones in its `attention_mask` row when its micro-batch has one (padding
does not count), else the elements of its row of the micro-batch's largest per-sample tensor, else (a list of
per-sample tensors) its tensor's elements. Dynamic padding makes every sample of a micro-batch as long as its
longest, so bisecting an out-of-memory step cannot tell that micro-batch's samples apart: each subset still
fails. A size outlier — at least OUTLIER_FACTOR x the step's median and the largest — is what names the
culprit, whether or not this replay (perhaps on a larger device) runs out of memory again.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from forensics.replay.run.execute import SampleRef

OUTLIER_FACTOR = 4.0
"""A sample at least this many times the step's median size is an outlier (dynamic padding then makes its whole
micro-batch that long; attention memory grows with the square of it)."""
SHOWN = 5


@dataclass(frozen=True)
class SampleSize:
    """One sample's size (tokens, or elements: SizeSummary.measure says which)."""

    ref: SampleRef
    tokens: int

    def as_dict(self) -> dict:
        return {
            "sample_id": self.ref.sample_id,
            "micro_batch": self.ref.micro_batch,
            "index": self.ref.index,
            "tokens": self.tokens,
        }


def sample_sizes(micro_batches: list[Any], refs: list[SampleRef]) -> tuple[list[SampleSize], str | None]:
    """Each sample's size and how it was measured ("attention_mask", "row elements", "tensor elements"), or
    ([], None) when the micro-batches do not say."""
    sizes: list[SampleSize] = []
    measure: str | None = None
    for mb, batch in enumerate(micro_batches):
        mine = [r for r in refs if r.micro_batch == mb]
        counts, how = _sizes_of(batch, len(mine))
        if counts is None:
            continue
        measure = measure or how
        sizes.extend(SampleSize(ref, int(n)) for ref, n in zip(mine, counts))
    return sizes, measure


def _sizes_of(batch: Any, n: int) -> tuple[list[int] | None, str]:
    if n == 0:
        return None, ""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() >= 2 and mask.shape[0] == n:
            return [int(v) for v in (mask.reshape(n, -1) != 0).sum(dim=1).tolist()], "attention_mask"
        rows = [v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n]
        if rows:
            largest = max(rows, key=lambda t: t.numel())
            return [largest[0].numel()] * n, "row elements"
        return None, ""
    if isinstance(batch, torch.Tensor) and batch.dim() >= 1 and batch.shape[0] == n:
        return [batch[0].numel()] * n, "row elements"
    if isinstance(batch, (list, tuple)) and len(batch) == n and all(isinstance(t, torch.Tensor) for t in batch):
        return [t.numel() for t in batch], "tensor elements"
    return None, ""


@dataclass(frozen=True)
class SizeSummary:
    """The step's sample sizes for an out-of-memory step: the report's `exception.sizes` (as_dict)."""

    measure: str | None
    """How a size was measured: "attention_mask", "row elements" or "tensor elements"."""
    median: float
    largest: tuple[SampleSize, ...]
    """The SHOWN largest samples, largest first."""
    outliers: tuple[SampleSize, ...]
    """Samples at least OUTLIER_FACTOR x the median (the SHOWN largest), largest first."""
    outlier_factor: float = OUTLIER_FACTOR

    def as_dict(self) -> dict:
        return {
            "measure": self.measure,
            "median": self.median,
            "largest": [s.as_dict() for s in self.largest],
            "outliers": [s.as_dict() for s in self.outliers],
            "outlier_factor": self.outlier_factor,
        }


def size_summary(micro_batches: list[Any], refs: list[SampleRef]) -> SizeSummary | None:
    """The step's median size, the largest samples and the outliers (None when the micro-batches do not say)."""
    sizes, measure = sample_sizes(micro_batches, refs)
    if not sizes:
        return None
    median = statistics.median(s.tokens for s in sizes)
    ranked = sorted(sizes, key=lambda s: -s.tokens)
    outliers = [s for s in ranked if median > 0 and s.tokens >= OUTLIER_FACTOR * median] if len(sizes) > 1 else []
    return SizeSummary(measure, median, tuple(ranked[:SHOWN]), tuple(outliers[:SHOWN]))


def longer_than(micro_batches: list[Any], refs: list[SampleRef], limit: int) -> list[SampleSize]:
    """The samples whose own length (their attention_mask tokens: padding does not count) exceeds `limit`, the
    model's context length, longest first; [] when the micro-batches have no attention mask to say."""
    sizes, measure = sample_sizes(micro_batches, refs)
    if measure != "attention_mask":
        return []
    return sorted((s for s in sizes if s.tokens > limit), key=lambda s: -s.tokens)


def outlier_refs(summary: SizeSummary | None, refs: list[SampleRef]) -> list[SampleRef]:
    """The SampleRefs of the summary's outliers, in `refs` order."""
    wanted = {(o.ref.micro_batch, o.ref.index) for o in (summary.outliers if summary is not None else ())}
    return [r for r in refs if (r.micro_batch, r.index) in wanted]
