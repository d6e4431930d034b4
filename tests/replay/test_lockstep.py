"""Lockstep (replay/run/lockstep.py): passes run block-major leave the RNG as running them one after another would."""

from __future__ import annotations

import torch

from forensics.replay.run.lockstep import Lockstep


def test_the_rng_after_passes_run_together_is_the_last_passs_as_run_alone():
    """Pass 0 waits for a block while pass 1 runs to its end, so pass 0 ends last in time; run alone in order, pass 1
    ends last: the RNG after the lockstep is pass 1's end (each pass starts from the same state), not pass 0's."""
    lockstep = Lockstep(device=torch.device("cpu"))

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


def test_micro_batches_run_together_are_summed_in_their_order_not_the_engines():
    """MicroBatchFold (replay/run/stream_blocks.py): the gradients of micro-batches run together, handed over in
    whatever order the engine runs their graphs, are summed as the micro-batches one after another sum them: ((held +
    g0) + g1) + g2. In float32 1e8 + 1 is 1e8: the order of the sum is the number."""
    from forensics.replay.run.stream_blocks import MicroBatchFold

    def t(value: float) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.float32)

    g = [t(1e8), t(-1e8), t(1.0)]
    sequential = (g[0] + g[1]) + g[2]
    assert torch.equal(sequential, t(1.0)) and not torch.equal((g[2] + g[1]) + g[0], sequential)

    fold = MicroBatchFold(3, final=True)
    for number in range(3):
        fold.ran(0, number)
    nothing = lambda name: None  # noqa: E731 - nothing held from earlier micro-batches
    assert fold.block_done(0, 2, {"w": g[2].clone()}, nothing) is None  # the engine hands the last one first
    assert fold.block_done(0, 1, {"w": g[1].clone()}, nothing) is None
    summed = fold.block_done(0, 0, {"w": g[0].clone()}, nothing)
    assert summed is not None and torch.equal(summed["w"], sequential) and not fold.unsure

    # held from an earlier group of the pass: first in the sum, as the micro-batches one after another add to it
    held = t(-1e8)
    fold = MicroBatchFold(2, final=False)
    fold.add(1, "head", t(1.0), lambda name: held)
    fold.add(0, "head", t(1e8), lambda name: held)
    assert torch.equal(fold.rest(lambda name: held)["head"], (held + t(1e8)) + t(1.0))

    # a block run twice in one micro-batch's forward: its sum would be another one (the pass runs one after another)
    fold = MicroBatchFold(2, final=True)
    fold.ran(0, 0)
    fold.ran(0, 0)
    assert fold.unsure
