"""RNG dependence: does a reproduced failure need the dump's random state (a dropout mask, a random op)?

A step that fails with each micro-batch's recorded RNG is re-run a few times WITHOUT restoring it,
from fixed other seeds. If any of those runs is healthy, the failure depends on the random state:
no sample, weight or precision setting alone explains it. The seeds are fixed so that a report is
itself reproducible; the caller's global RNG state is put back afterwards.
"""

from __future__ import annotations

import functools
import logging
import random
from typing import Iterable, TypedDict

import torch

from forensics.core.kinds import TriggerKind
from forensics.core.rng import capture_rng, restore_rng
from forensics.replay.run.execute import StepResult, StepRunner

logger = logging.getLogger(__name__)

# Three unrelated seeds. A failure that needs one dropout mask in p of all draws survives all three
# with probability about p**3 (the demo's all-gates-dropped mask, p ~ 1/8 a step: 0.2 %).
DEFAULT_SEEDS = (1234, 98765, 424242)


class RngBlock(TypedDict):
    """The report's `rng` block."""

    checked: bool
    seeds: list[int]
    """The seeds run, in order (the check stops at the first healthy one)."""
    failed: list[bool]
    """Per seed: the step still failed."""
    rng_dependent: bool | None
    """True when some seed gave a healthy step; None: not checked."""


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also every CUDA device
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        return
    np.random.seed(seed % 2**32)


def _run_from(runner: StepRunner, seed: int, backward: bool = False) -> StepResult:
    """The whole step from `seed`, the recorded RNG not restored."""
    _seed_everything(int(seed))
    return runner.run(restore_rng=False, backward=backward)


def check_rng_dependence(
    runner: StepRunner, kind: str, threshold: float | None = None, seeds: tuple[int, ...] = DEFAULT_SEEDS
) -> RngBlock:
    """Re-runs the whole step from other seeds (recorded RNG not restored) and says whether it still fails.

    Args:
        runner: the step runner of a session whose failure reproduced with the recorded RNG.
        kind: the trigger kind (StepResult.trigger_reproduced).
        threshold: the spike threshold, if any.
        seeds: the seeds tried, in order; stops at the first healthy run.
    Returns:
        The report's `rng` block: {"checked": True, "seeds": [seeds run], "failed": [bool per seed],
        "rng_dependent": bool} — rng_dependent is True when some seed gave a healthy step.
    Example:
        >>> block = check_rng_dependence(StepRunner(session), "nonfinite_loss")  # doctest: +SKIP
        >>> block["rng_dependent"]  # doctest: +SKIP
        True
    """
    needs_backward = TriggerKind.parse(kind).needs_backward
    saved = capture_rng()
    tried, failed = [], []
    try:
        results: Iterable[StepResult]
        if runner.block_major and not needs_backward:  # every seed's forward in one walk over the blocks
            with runner.speculating():
                results = runner.run_forwards([functools.partial(_run_from, runner, seed) for seed in seeds])
        else:
            results = (_run_from(runner, seed, needs_backward) for seed in seeds)
        for seed, result in zip(seeds, results):
            tried.append(int(seed))
            failed.append(bool(result.trigger_reproduced(kind, threshold)))
            if not failed[-1]:
                break
    finally:
        restore_rng(saved)
        runner.reset()
    dependent = bool(tried) and not all(failed)
    if dependent:
        logger.info("the %s needs the recorded RNG: from seed %d the step is healthy", kind, tried[-1])
    return {"checked": True, "seeds": tried, "failed": failed, "rng_dependent": dependent}


__all__ = ["check_rng_dependence", "DEFAULT_SEEDS", "RngBlock"]
