"""Find the samples that make a step fail: delta debugging (Zeller's ddmin), binary split first.

`ddmin(candidates, fails)` returns a 1-minimal failing subset: `fails(culprits)` is true and
removing any single element makes it pass. Each evaluation of `fails` is a replay (forward, and
usually backward) of a sub-batch, so the number of evaluations is what matters:

* Every subset is tried at most once (answers are memoised on the frozen set of positions).
  `fails(all candidates)` is taken as true (the caller checked it) and is not run or counted.
* Granularity starts at 2 and returns to 2 after every reduction, so while one half fails on its
  own the search is a binary split: ONE culprit among n costs at most 2 * ceil(log2 n) runs, within
  the budget 2 * log2(n) + 4 the report states (`bisection.budget`, rounded up).
* At the first split both halves are always tried. If every run fails (`all_failed`), the failure
  does not depend on which samples are fed: model state, not data.
* When neither half fails on its own the samples fail only together (e.g. two samples whose
  combination overflows a batch statistic); ddmin then tries complements and finer splits.
* `prefetch`, when given, is told the subsets ddmin may test next before it tests the first of them
  (the parts of a split, then the complements): a caller that answers several subsets for about
  the cost of one (a streamed replay runs forward passes together, block by block) answers them
  there and `fails` reads the answers. Only the subsets `fails` is asked about count as runs,
  so the search, its runs and its result are those of a search without it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class BisectResult(Generic[T]):
    """What `ddmin` found."""

    culprits: list[T]
    """A 1-minimal failing subset, in the candidates' order (all candidates if there is one or none)."""
    runs: int
    """Predicate evaluations actually executed (memo hits and the assumed full set not counted)."""
    budget: int
    """`bisect_budget(len(candidates))`: the runs one culprit should cost at most."""
    all_failed: bool = False
    """True when at least one run was made and every run failed: no subset passes, so suspect
    the model state rather than the data."""
    minimal: bool = True
    """False when `max_runs` stopped the search early; `culprits` then still fails but may not be
    1-minimal."""


def bisect_budget(n: int) -> int:
    """Runs allowed to find one culprit among `n` samples: ceil(2 * log2(n) + 4); 0 when n == 0."""
    if n <= 0:
        return 0
    return math.ceil(2 * math.log2(n) + 4)


def _split(items: list[int], n: int) -> list[list[int]]:
    """`items` cut into `n` contiguous parts whose sizes differ by at most one."""
    size, extra = divmod(len(items), n)
    parts, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        parts.append(items[start:end])
        start = end
    return parts


class _BudgetSpent(Exception):
    pass


def ddmin(
    candidates: Sequence[T],
    fails: Callable[[list[T]], bool],
    *,
    max_runs: int | None = None,
    prefetch: Callable[[list[list[T]]], None] | None = None,
) -> BisectResult[T]:
    """A 1-minimal subset of `candidates` for which `fails` is true.

    Args:
        candidates: the samples (any objects, e.g. `SampleRef`s); duplicates are fine, they are
            told apart by position.
        fails: called with a list of candidates (a proper, non-empty subset, in the candidates'
            order); true when that subset reproduces the failure. Exceptions propagate.
        max_runs: stop after this many runs and return the smallest failing subset found so far
            (`minimal=False`); None: no limit (ddmin's worst case is quadratic in n).
        prefetch: called with the subsets not yet answered that ddmin may test next (lists of
            candidates, as `fails` gets them), before it tests the first; None: nothing to tell.
    Returns:
        A `BisectResult`.
    Example:
        >>> r = ddmin(list(range(32)), lambda s: 17 in s)
        >>> r.culprits, r.runs <= r.budget
        ([17], True)
    """
    items = list(candidates)
    budget = bisect_budget(len(items))
    memo: dict[frozenset[int], bool] = {frozenset(range(len(items))): True}
    runs = 0
    failed_runs = 0

    def test(positions: list[int]) -> bool:
        nonlocal runs, failed_runs
        key = frozenset(positions)
        if key in memo:
            return memo[key]
        if max_runs is not None and runs >= max_runs:
            raise _BudgetSpent
        runs += 1
        outcome = bool(fails([items[p] for p in positions]))
        failed_runs += outcome
        memo[key] = outcome
        log.debug(
            "bisect run %d: %d of %d samples -> %s", runs, len(positions), len(items), "fails" if outcome else "passes"
        )
        return outcome

    def ahead(subsets: list[list[int]]) -> None:
        if prefetch is None:
            return
        unknown = [p for p in subsets if frozenset(p) not in memo]
        if max_runs is not None:
            unknown = unknown[: max(0, max_runs - runs)]
        if len(unknown) > 1:
            prefetch([[items[p] for p in part] for part in unknown])

    current = list(range(len(items)))
    n = 2
    first_split = True
    minimal = True
    try:
        while len(current) >= 2:
            parts = _split(current, n)
            ahead(parts)
            if first_split:
                outcomes = [test(p) for p in parts]  # both halves, so all_failed means something
                first_split = False
                failing = next((p for p, o in zip(parts, outcomes) if o), None)
            else:
                failing = next((p for p in parts if test(p)), None)
            if failing is not None:
                current, n = failing, 2
                continue
            if n > 2:  # with two parts the complements are the parts themselves
                complements = [[q for q in current if q not in excluded] for excluded in (set(p) for p in parts)]
                ahead(complements)
                complement = next((c for c in complements if test(c)), None)
                if complement is not None:
                    current, n = complement, max(n - 1, 2)
                    continue
            if n >= len(current):
                break
            n = min(len(current), 2 * n)
    except _BudgetSpent:
        minimal = False
        log.warning(
            "bisection stopped after %d runs (max_runs); the culprit set of %d may not be minimal", runs, len(current)
        )
    culprits = [items[p] for p in sorted(current)]
    log.info(
        "bisection: %d culprit(s) among %d candidates in %d runs (budget %d)", len(culprits), len(items), runs, budget
    )
    return BisectResult(
        culprits=culprits, runs=runs, budget=budget, all_failed=runs > 0 and failed_runs == runs, minimal=minimal
    )
