"""What a healthy guarded step costs, counted, not timed: the operators the Guard's calls (and its hooks on the model
and the optimizer) dispatch, the host reads of device data they make, the Python functions they run and the heap they
hold, per step of a fixed small model, and the same at ten times its parameter tensors. The budget is written below; a change that adds work to the hot path (a device sync in check(), a window walked every
step, an RNG state copied again) fails here and the message says which call grew, by what, and its most frequent
Python functions.

The counts (TorchDispatchMode, a tensor subclass that records host reads, sys.setprofile, tracemalloc) do not depend
on the machine's speed. Python calls vary a little with the torch version (torch.cuda.is_available is Python): their
budget has a margin (PYTHON_MARGIN); operators and host reads have none.
"""

from __future__ import annotations

import random
import sys
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field

import numpy
import pytest
import torch

from forensics.capture import Guard, GuardConfig
from forensics.core.thirdparty import TorchDispatchMode
from forensics_test_helpers import Watched

MICRO_BATCHES = 2
PYTHON_MARGIN = 1.25  # Python calls may grow 25 % (another torch version) before the test fails


@dataclass(frozen=True)
class Budget:
    ops: int  # operators dispatched (views included: each is host time; on a GPU most others are a kernel launch)
    host_reads: int  # device->host reads of the loop's tensors (.item/.tolist/float()/bool()/.cpu() ... of them)
    scalar_reads: int  # aten::_local_scalar_dense of any tensor (behind every .item/float()/bool()): a sync each
    python_calls: int  # Python function calls (sys.setprofile 'call' events), before PYTHON_MARGIN
    peak_kb: float  # the most Python-heap memory (tracemalloc, numpy arrays included) one call holds at its peak


# Per healthy step of 2 micro-batches, as measured on the code of this commit (torch 2.13, CPU), for each check the
# default configuration picks (capture/detection/step.py). record_loss keeps a detached reference. The synchronous check
# (AdamW's for-each step) stacks the step's numbers (one operator) and reads them in one transfer (tolist). The
# sync-free check (AdamW(fused=True)) reads nothing: its 13 operators (on a GPU, 12 small kernels queued behind
# backward and the copy; no view, no cat: 18 operators before 2026-11-28) stack the numbers and cast them in place into
# the float64 row the check keeps on the device (the losses kept detached: no second detach), sum the step loss into
# it, flag a non-finite value or a spike to hold (two thresholds, one `or` when any spike is held) into its last slot,
# take found_inf from that slot, and start one non-blocking copy of the row into the host buffer the previous step's
# numbers were read from (no allocation per step). check() also hands
# the history's row to the run log (capture/recording/run_log.py): a tuple of the step's scalars appended, about 0.2 KB.
# record_batch: no CUDA-availability calls once CUDA is initialised, no ABC check of a dict batch (issue 55).
BUDGET = {
    "record_batch": Budget(ops=0, host_reads=0, scalar_reads=0, python_calls=25, peak_kb=8),  # RNG shared if unchanged
    "record_loss": Budget(ops=2 * 1, host_reads=0, scalar_reads=0, python_calls=2 * 2, peak_kb=1),
    # the Guard's hooks on the model (the autocast state, read at a step's first forward) and on the optimizer (stepped
    # since the last check? the sync-free flag's removal): host bookkeeping only
    "hooks": Budget(ops=0, host_reads=0, scalar_reads=0, python_calls=6, peak_kb=1),
}
CHECK_BUDGET = {
    "synchronous": Budget(ops=1, host_reads=1, scalar_reads=0, python_calls=45, peak_kb=2.5),
    "sync_free": Budget(ops=13, host_reads=0, scalar_reads=0, python_calls=66, peak_kb=3.5),
}


@dataclass
class Cost:
    ops: Counter = field(default_factory=Counter)
    host_reads: list = field(default_factory=list)
    scalar_reads: int = 0
    python: Counter = field(default_factory=Counter)
    peak_kb: float = 0.0


class CountOps(TorchDispatchMode):
    def __init__(self, cost: Cost):
        super().__init__()
        self.cost = cost

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.cost.ops[str(func)] += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.cost.scalar_reads += 1
        return func(*args, **(kwargs or {}))


PASSES = ("ops and host reads", "Python calls", "heap")  # each counted over its own steps: no counter counts another


def counted(cost: Cost, what: str, call, *args, **kwargs):
    """`call(*args, **kwargs)` with `what` it costs (one of PASSES) added to `cost`."""
    if what == "heap":
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        try:
            return call(*args, **kwargs)
        finally:
            cost.peak_kb = max(cost.peak_kb, (tracemalloc.get_traced_memory()[1] - before) / 1024)
    if what == "Python calls":

        def profile(frame, event, arg):
            if event == "call":
                code = frame.f_code
                cost.python[f"{'/'.join(code.co_filename.split('/')[-2:])}:{code.co_name}"] += 1

        sys.setprofile(profile)
        try:
            return call(*args, **kwargs)
        finally:
            sys.setprofile(None)
    Watched.reads = []
    try:
        with CountOps(cost):
            return call(*args, **kwargs)
    finally:
        cost.host_reads.extend(Watched.reads)


def healthy_steps(dump_dir, steps: int, check: str, warm: int = 40, layers: int = 3) -> dict[str, Cost]:
    """What the Guard's calls cost over healthy steps after `warm` (past the first check()'s usage look and the spike
    detectors' warm-up) of `layers` x Linear(16) trained by AdamW with clip_grad_norm_: `steps` steps per pass.
    `check`: a key of CHECK_BUDGET (the optimizer that makes the default configuration pick it)."""
    torch.manual_seed(0)
    random.seed(0)  # whatever an earlier test left (numpy's cached Gaussian forces a full state copy per micro-batch)
    numpy.random.seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=check == "sync_free")
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(dump_dir)), loss_fn=squared_output)
    costs = {name: Cost() for name in (*BUDGET, "check")}
    passing: list[str | None] = [None]  # the pass the hooks' calls are counted in (None: not counted)

    def counted_hook(hook):
        def hook_call(*args, **kwargs):
            return (
                hook(*args, **kwargs)
                if passing[0] is None
                else counted(costs["hooks"], passing[0], hook, *args, **kwargs)
            )

        return hook_call

    data = torch.randn(warm + len(PASSES) * steps, MICRO_BATCHES, 4, 16)

    def call(name: str, step: int, method, *args, **kwargs):
        if step < warm:
            return method(*args, **kwargs)
        what = PASSES[(step - warm) // steps]
        if what == "ops and host reads":  # the loop's tensors record every host read of their data
            args = [a.as_subclass(Watched) if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: v.as_subclass(Watched) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return counted(costs[name], what, method, *args, **kwargs)

    try:
        for step in range(warm + len(PASSES) * steps):
            if step == warm:  # every hook is in place (the sync-free check adds its own at the first check)
                for hooks in (model._forward_pre_hooks, *optimizer_hooks(optimizer)):
                    hooks.update({key: counted_hook(hook) for key, hook in hooks.items()})
            passing[0] = PASSES[(step - warm) // steps] if step >= warm else None
            if step == warm + PASSES.index("heap") * steps:
                tracemalloc.start()
            for index in range(MICRO_BATCHES):
                batch = {"x": data[step, index], "sample_ids": [step * MICRO_BATCHES + index]}
                call("record_batch", step, guard.record_batch, batch)
                loss = squared_output(model, batch)
                call("record_loss", step, guard.record_loss, loss)
                (loss / MICRO_BATCHES).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert call("check", step, guard.check, grad_norm=norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        tracemalloc.stop()
    assert guard.dumps == [] and guard.dump_errors == []
    guard.close()
    return costs


def squared_output(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"]).pow(2).mean()


def optimizer_hooks(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The optimizer's step pre- and post-hook dictionaries (torch.optim.Optimizer's; every hook there is the Guard's)."""
    return optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks


def over_budget(costs: dict[str, Cost], steps: int, check: str) -> list[str]:
    """One line per count above its budget, saying what grew."""
    grown = []
    for name, budget in {**BUDGET, "check": CHECK_BUDGET[check]}.items():
        cost = costs[name]
        ops, reads = sum(cost.ops.values()) / steps, len(cost.host_reads) / steps
        calls = sum(cost.python.values()) / steps
        if ops > budget.ops:
            grown.append(
                f"{name}: {ops:g} operators per step, budget {budget.ops}: {dict(cost.ops)} over {steps} steps"
            )
        if reads > budget.host_reads:
            grown.append(
                f"{name}: {reads:g} host reads of the loop's tensors per step, budget {budget.host_reads} "
                f"(each one a device sync on a GPU): {dict(Counter(cost.host_reads))} over {steps} steps"
            )
        if cost.scalar_reads / steps > budget.scalar_reads:
            grown.append(
                f"{name}: {cost.scalar_reads / steps:g} aten::_local_scalar_dense per step (.item(), float(), "
                f"bool() of a tensor: a device sync each on a GPU), budget {budget.scalar_reads}"
            )
        if calls > budget.python_calls * PYTHON_MARGIN:
            top = ", ".join(f"{where} x{count / steps:g}" for where, count in cost.python.most_common(8))
            grown.append(
                f"{name}: {calls:g} Python calls per step, budget {budget.python_calls} "
                f"(+{PYTHON_MARGIN - 1:.0%}); most called: {top}"
            )
        if cost.peak_kb > budget.peak_kb:
            grown.append(f"{name}: holds {cost.peak_kb:.1f} KB of Python heap at its peak, budget {budget.peak_kb} KB")
    return grown


@pytest.mark.parametrize("check", list(CHECK_BUDGET))
def test_a_healthy_step_stays_within_its_counted_budget(tmp_path, check):
    steps = 5
    costs = healthy_steps(tmp_path, steps, check)
    grown = over_budget(costs, steps, check)
    assert not grown, f"the Guard's healthy path ({check} check) grew:\n" + "\n".join(grown)
    # the budget is tight too: a saving shows up as a budget to lower, not as silent slack
    calls = sum(costs["check"].python.values()) / steps
    budget = CHECK_BUDGET[check].python_calls
    assert calls >= budget / 2, f"check() now runs {calls:g} Python calls: lower its budget"


@pytest.mark.parametrize("check", list(CHECK_BUDGET))
def test_a_healthy_step_costs_the_same_whatever_the_parameter_count(tmp_path, check):
    """Nothing on the healthy path walks the parameters in Python or launches an operator per parameter: 10 times
    the parameter tensors, the same operators and Python calls per step (a 70 B model has thousands of tensors)."""
    steps = 3
    small, large = (healthy_steps(tmp_path / str(layers), steps, check, layers=layers) for layers in (3, 30))
    for name in small:
        assert small[name].ops == large[name].ops, f"{name}: operators grew with the parameter count"
        grown = {
            where: (small[name].python[where], count)
            for where, count in large[name].python.items()
            if count > small[name].python[where]
        }
        assert not grown, f"{name}: Python calls grew with the parameter count (3 -> 30 layers, {steps} steps): {grown}"
