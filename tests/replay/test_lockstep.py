"""Lockstep (replay/run/lockstep.py): passes run block-major leave the RNG as running them one after another would."""

from __future__ import annotations

import torch

from forensics.replay.run.lockstep import Lockstep


def test_the_rng_after_passes_run_together_is_the_last_passs_as_run_alone():
    """Pass 0 waits for a block while pass 1 runs to its end, so pass 0 ends last in time; run alone in order, pass 1
    ends last: the RNG after the lockstep is pass 1's end (each pass starts from the same state), not pass 0's."""
    lockstep = Lockstep(holds=lambda index: False, device=torch.device("cpu"))

    def first() -> torch.Tensor:
        lockstep.need(0)  # hands the baton on: pass 1 runs to its end before this one goes on
        return torch.rand(1)

    def second() -> torch.Tensor:
        return torch.rand(3)

    torch.manual_seed(123)
    first_alone = torch.rand(1)
    torch.manual_seed(123)
    second_alone = torch.rand(3)
    after_alone = torch.rand(2)  # the next draw after the passes run alone, pass 1 last

    torch.manual_seed(123)
    together = lockstep.run([first, second])
    assert torch.equal(together[0], first_alone) and torch.equal(together[1], second_alone)
    assert torch.equal(torch.rand(2), after_alone)
