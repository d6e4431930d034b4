"""How far one optimizer update moves the weights, relative to their norm: the measure every stage that judges an
update uses (the window replay's "this step broke the run", the optimizer localisation, the remedies' health)."""

from __future__ import annotations

import math

WRECK_RATIO = 0.5
"""An update larger than this fraction of the weights' norm (whole model) in one step wrecks them."""


def relative_change(moved_sq: float, size_sq: float) -> float:
    """|update| / |weights| from their squared L2 norms (inf for zero weights that moved, or a non-finite update)."""
    if not math.isfinite(moved_sq):
        return math.inf
    if size_sq > 0:
        return math.sqrt(moved_sq / size_sq)
    return 0.0 if moved_sq == 0 else math.inf
