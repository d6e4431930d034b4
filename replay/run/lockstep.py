"""Run, streamed: several passes of one stage run block-major, each block brought to the device once for all of them
(FlexGen's block schedule, for a model whose forward is the user's code and cannot be cut into blocks).

`Lockstep.run(jobs)` runs each job (one pass: StepRunner.run) on a thread of its own, one thread at a time (a baton). A
pass that needs a block (BlockStreamer.acquire asks `need`) hands the baton to the next pass; once every pass waits, the
lowest block they wait for is materialised, once, and each pass waiting for it runs through it in turn, in the jobs'
order. A block still materialised from before is waited for too: the passes stay in step (one that ran ahead through
such blocks would make the others walk them again, and could find them evicted). Every pass computes what it would
alone: the global RNG states (torch, CUDA, Python, numpy) are each pass's own, saved when it hands the baton on and put
back when it gets it again; grad mode and autocast are per thread already; what else is a pass's own (a streamed
runner's gradients and the parameters outside the blocks: `switch`) is put in place when it gets the baton and taken
away when it hands it on; what each pass sets up for the process and tears down at its end (the warnings filters,
FSDP2's compute dtypes: StreamedStepRunner counts its users) is put back once, when the last pass is over.

Forward-only passes (`run(jobs)`) run without autograd: each keeps only its current hidden state. Passes with a
backward (`run(jobs, grad=True)`: the per-sample rows) record their graphs (a streamed block keeps only its inputs,
replay/run/stream_blocks.py) and hand their micro-batch's loss to `backward` instead of calling backward themselves;
once every pass has handed one (or is over), ONE call of the autograd engine runs the backward of all of them
(`torch.autograd.backward(roots)`). Not one backward per pass on its own thread: on CUDA the engine runs every
graph's backward on one device thread, so a pass's backward waiting there for a block would block the others' for
good. In one engine call nothing waits: the engine runs the ready nodes latest first by sequence number, a
per-thread counter that each pass's thread starts from 0, so the passes' nodes of the same block carry the same
numbers and the blocks' backwards run block by block, each block's for every pass while it is materialised. Each
pass's graph is its own (its own leaves for the parameters outside the blocks: `switch`), so each accumulates what it
would alone, in the same order (the engine orders one graph's nodes the same whatever else it runs). An exception in
that engine call is kept in `backward_error` and the passes finish without it: the caller runs them again in smaller
groups (out of memory) or alone.

The jobs may also be the micro-batches of ONE pass (StreamedStepRunner._run_group): the switch gives each its own
leaves outside the blocks, and what their backwards make is summed in the micro-batch order by
replay/run/stream_blocks.MicroBatchFold, not by the engine, which runs the nodes of different graphs carrying the
same sequence number in no fixed order (a sum of three or more depends on the order).
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, Protocol, Sequence, TypeVar

import torch

from forensics.core.rng import capture_rng, restore_rng

T = TypeVar("T")


class PassSwitch(Protocol):
    """What is each pass's own beyond the RNG: put in place (`enter`) when a pass gets the baton, taken away
    (`leave`) when it hands it on or ends."""

    def enter(self, number: int) -> None: ...

    def leave(self, number: int) -> None: ...


class Lockstep:
    """Passes run together, block by block (see the module's docstring)."""

    def __init__(self, device: torch.device, switch: PassSwitch | None = None):
        self.device, self._switch = device, switch
        self._cond = threading.Condition()
        self._count = 0
        self._turn: int | None = None
        self._waiting: dict[int, int] = {}
        """Pass -> the block it waits for."""
        self._done: set[int] = set()
        self._ids: dict[int, int] = {}
        """Thread ident -> its pass."""
        self.waits = 0
        """Times a pass handed the baton on to wait for a block."""
        self._roots: dict[int, torch.Tensor] = {}
        """Pass -> the loss it handed to `backward`, waiting for the engine call of all of them."""
        self._run_backward = False
        self._in_backward = False
        self.backwards = 0
        """Engine calls that ran the backward of several passes."""
        self.backward_error: BaseException | None = None

    def run(self, jobs: Sequence[Callable[[], T]], grad: bool = False) -> list[T]:
        """Each job's result, in order; the first exception a job raised is raised once every job is over. `grad`:
        the passes record autograd graphs and run their backwards through `backward`."""
        self._count, self._turn = len(jobs), None
        self._roots.clear()
        self._run_backward, self.backward_error = False, None
        self._waiting.clear()
        self._done.clear()
        self._ids.clear()
        results: list = [None] * len(jobs)
        errors: list[BaseException | None] = [None] * len(jobs)
        start = capture_rng()
        ends: list = [start] * len(jobs)  # each pass's RNG state at its end
        filters, show = warnings.filters[:], warnings.showwarning

        def task(number: int) -> None:
            with self._cond:
                self._ids[threading.get_ident()] = number
                self._cond.wait_for(lambda: self._turn == number)
            try:
                if self.device.type == "cuda":  # a thread starts on cuda:0, whatever the replay's device
                    torch.cuda.set_device(self.device)
                restore_rng(start)  # each pass starts from the same state (the jobs restore or seed their own)
                self._enter(number)
                with torch.set_grad_enabled(grad):
                    results[number] = jobs[number]()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors[number] = exc
            finally:
                ends[number] = capture_rng()
                self._leave(number)
                with self._cond:
                    self._done.add(number)
                    self._waiting.pop(number, None)
                    self._roots.pop(number, None)
                    self._pass_on(number)

        threads = [
            threading.Thread(target=task, args=(n,), name=f"forensics-lockstep-{n}", daemon=True)
            for n in range(len(jobs))
        ]
        for thread in threads:
            thread.start()
        with self._cond:
            self._turn = 0 if jobs else None
            self._cond.notify_all()
        for thread in threads:
            thread.join()
        self._ids.clear()
        # each pass entered and left warnings.catch_warnings (StepRunner.run) at its own time: not nested, they
        # leave the process-wide filters of whichever entered first; put back what was there, as catch_warnings does
        warnings.filters, warnings.showwarning = filters, show
        getattr(warnings, "_filters_mutated", lambda: None)()  # the filters' cache invalidated (CPython's own hook)
        if jobs:
            restore_rng(ends[-1])  # as after the passes run alone, one after another: the last job's end
        for error in errors:
            if error is not None:
                raise error
        return results

    def need(self, index: int) -> None:
        """Called before a block is materialised: a pass (of this lockstep) waits until every pass needs a block,
        then runs through it when its turn comes (the lowest block first); anything else goes on (the engine call of
        `backward` too, which runs every pass's blocks in turn)."""
        number = self._ids.get(threading.get_ident())
        if number is None or self._in_backward:
            return
        saved = capture_rng()
        self._leave(number)
        with self._cond:
            self.waits += 1
            self._waiting[number] = index
            self._pass_on(number)
            self._cond.wait_for(lambda: self._turn == number)
        self._enter(number)
        restore_rng(saved)

    def backward(self, root: torch.Tensor) -> None:
        """A pass's micro-batch backward: `root` kept until every pass of this lockstep has handed one (or is over),
        then one engine call runs all of them (by the pass whose turn it is then); the pass goes on when its turn
        comes again. Outside a lockstep run: root.backward()."""
        number = self._ids.get(threading.get_ident())
        if number is None or self._in_backward:
            root.backward()
            return
        saved = capture_rng()
        self._leave(number)
        with self._cond:
            self._roots[number] = root
            self._pass_on(number)
            self._cond.wait_for(lambda: self._turn == number and (self._run_backward or number not in self._roots))
            roots = [self._roots[n] for n in sorted(self._roots)] if self._run_backward else []
            if self._run_backward:
                self._in_backward = True
        if roots:
            try:
                torch.autograd.backward(roots)
            except Exception as exc:  # noqa: BLE001 - no one pass's: the caller runs the passes again alone
                self.backward_error = self.backward_error or exc
            finally:
                with self._cond:
                    self.backwards += 1
                    self._in_backward = self._run_backward = False
                    self._roots.clear()  # each pass goes on when its turn comes (this one now)
        self._enter(number)
        restore_rng(saved)

    def _enter(self, number: int) -> None:
        if self._switch is not None:
            self._switch.enter(number)

    def _leave(self, number: int) -> None:
        if self._switch is not None:
            self._switch.leave(number)

    def _pass_on(self, me: int) -> None:
        """The baton to the next pass after `me` that can run; when all wait, to the first of those waiting for the
        lowest block (each of them runs through it in turn); when every pass left waits in `backward`, to the first
        of them, which runs the engine call. Called with the lock held."""
        order = [(me + step) % self._count for step in range(1, self._count + 1)]
        ready = [n for n in order if n not in self._done and n not in self._waiting and n not in self._roots]
        if not ready and self._waiting:
            lowest = min(self._waiting.values())
            ready = sorted(n for n, index in self._waiting.items() if index == lowest)
            for n in ready:
                del self._waiting[n]
        elif not ready and self._roots:  # every pass left has handed its loss: the first of them runs the backward
            ready, self._run_backward = [min(self._roots)], True
        self._turn = ready[0] if ready else None
        self._cond.notify_all()


__all__ = ["Lockstep", "PassSwitch"]
